"""What a recovery hands away to be dropped is dropped off its thread, by one thread however often it hands."""

from __future__ import annotations

import os
import threading
import time
import weakref

import torch

from shardkit.checkpoint.io import local_files
from shardkit.checkpoint.io.local_files import release_in_background


def _dropped_within(refs: list[weakref.ref], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(ref() is None for ref in refs):
            return True
        time.sleep(0.01)
    return False


def test_what_is_handed_away_is_dropped_and_one_thread_serves_every_call():
    refs = []
    for _ in range(20):
        tensor = torch.ones(1 << 16, dtype=torch.uint8)
        refs.append(weakref.ref(tensor))
        release_in_background([tensor])
        del tensor
    assert _dropped_within(refs)
    releasers = [t for t in threading.enumerate() if t.name == "shardkit-release"]
    assert len(releasers) == 1 and releasers[0].daemon


def test_a_child_forked_while_the_release_lock_was_held_still_releases():
    # a fork copies a lock another thread holds, held, with no thread left to release it: the child would wait
    # forever on its first hand-over unless it starts afresh
    releaser = local_files.RELEASER
    with releaser.lock:
        pid = os.fork()
        if pid == 0:  # the child: hand a tensor over and report whether it was dropped
            tensor = torch.ones(16)
            ref = weakref.ref(tensor)
            release_in_background([tensor])
            del tensor
            os._exit(0 if _dropped_within([ref], 5.0) else 1)
    deadline = time.monotonic() + 20.0
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid, "the forked child hung on its first hand-over"
    assert os.waitstatus_to_exitcode(done[1]) == 0
