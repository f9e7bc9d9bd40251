"""parallel_map runs on one reused thread pool per process: no threads started per call, nothing lost to
nesting or to many callers at once, fails fast, survives fork, and lets the interpreter exit at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from shardkit.checkpoint.io import concurrency
from shardkit.checkpoint.io.concurrency import parallel_map, shutdown_io_pool


def test_results_come_back_in_item_order():
    assert parallel_map(lambda x: x * x, range(50), 8) == [x * x for x in range(50)]


def test_repeated_calls_start_no_new_threads():
    parallel_map(lambda x: x, range(16), 8)  # the pool's threads exist after the first call
    started = []
    original = threading.Thread.start

    def counting_start(self):
        started.append(self.name)
        original(self)

    threading.Thread.start = counting_start
    try:
        for _ in range(20):
            assert parallel_map(lambda x: x + 1, range(8), 4) == list(range(1, 9))
    finally:
        threading.Thread.start = original
    assert started == []


def test_a_call_uses_at_most_workers_threads_at_once():
    running, most, lock = [0], [0], threading.Lock()

    def work(x):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return x

    assert parallel_map(work, range(24), 3) == list(range(24))
    assert most[0] <= 3


def test_the_first_failure_is_raised_and_items_not_started_are_not_run():
    ran = []

    def work(x):
        if x == 0:
            raise ValueError("item 0")
        time.sleep(0.02)
        ran.append(x)
        return x

    with pytest.raises(ValueError, match="item 0"):
        parallel_map(work, range(100), 2)
    assert len(ran) < 10  # the other thread finished what it had started, then stopped


def test_nested_calls_and_many_callers_at_once_all_finish():
    """Every pool thread busy with calls that wait on calls of their own must not deadlock."""
    def inner(x):
        return sum(parallel_map(lambda y: y, range(x % 5 + 2), 8))

    def outer(_):
        return parallel_map(inner, range(30), 8)

    callers = [threading.Thread(target=outer, args=(i,)) for i in range(concurrency.POOL_THREADS // 4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=60)
    assert not any(caller.is_alive() for caller in callers)
    assert parallel_map(inner, range(3), 8) == [1, 3, 6]


def test_after_a_shutdown_the_next_call_makes_a_new_pool():
    parallel_map(lambda x: x, range(4), 4)
    shutdown_io_pool()
    assert parallel_map(lambda x: -x, range(4), 4) == [0, -1, -2, -3]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_gets_a_pool_of_its_own():
    parallel_map(lambda x: x, range(8), 4)  # the parent's pool threads exist; the child has none of them
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        try:
            ok = parallel_map(lambda x: x * 2, range(16), 4) == [x * 2 for x in range(16)]
        finally:
            os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_program_that_used_the_pool_exits_at_once_and_cleanly():
    code = ("from shardkit.checkpoint.io.concurrency import parallel_map\n"
            "print(sum(parallel_map(lambda x: x, range(100), 8)))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "4950"
    assert run.stderr == ""
