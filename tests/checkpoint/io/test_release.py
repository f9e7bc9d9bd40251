"""What a recovery hands away to be dropped is dropped off its thread, by one thread however often it hands."""

from __future__ import annotations

import threading
import time
import weakref

import torch

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

