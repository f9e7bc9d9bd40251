"""Read-ahead hints on a local disk: a header's from the caller, a load's data from one hinting thread.

A ``POSIX_FADV_WILLNEED`` makes its caller wait while the kernel allocates the pages it will read; a cold
load's planning used to wait 2-5 ms (up to 20 on a busy machine) for its data hints, so those go to one
thread per process, and the caller goes on (``LocalDisk.prefetch``, :mod:`shardkit.checkpoint.io.read_ahead`).
"""

from __future__ import annotations

import threading

import pytest

from shardkit.checkpoint.io import read_ahead
from shardkit.checkpoint.io.storage import Storage


def _recording(monkeypatch, path: str, fail_first: bool = False):
    """Record the hints for ``path`` (another test's, still on the thread, are let through untouched)."""
    calls: list[tuple[str, list[tuple[int, int]], str]] = []
    seen = threading.Event()

    def hint(name, ranges):
        if name != path:
            return
        if fail_first and not calls:
            calls.append(("failed", [], threading.current_thread().name))
            raise RuntimeError("a hint that breaks")
        calls.append((name, list(ranges), threading.current_thread().name))
        seen.set()

    monkeypatch.setattr(read_ahead, "hint", hint)
    return calls, seen


@pytest.fixture
def data_file(tmp_path):
    (tmp_path / "data.bin").write_bytes(bytes(range(256)) * 64)
    return Storage(str(tmp_path)), str(tmp_path / "data.bin")


def test_a_header_sized_hint_is_given_by_the_caller(monkeypatch, data_file):
    storage, path = data_file
    calls, _ = _recording(monkeypatch, path)
    storage.prefetch("data.bin", [(0, 4096)])
    assert calls == [(path, [(0, 4096)], threading.current_thread().name)]  # done before prefetch returned


def test_a_data_sized_hint_goes_to_the_read_ahead_thread_and_the_caller_goes_on(monkeypatch, data_file):
    storage, path = data_file
    calls, seen = _recording(monkeypatch, path)
    ranges = [(0, read_ahead.INLINE_HINT_BYTES), (read_ahead.INLINE_HINT_BYTES + 4096, 8 << 20)]
    storage.prefetch("data.bin", ranges)
    assert seen.wait(10)
    assert calls == [(path, ranges, "shardkit-read-ahead")]


def test_a_hint_that_fails_leaves_the_thread_serving_the_next(monkeypatch, data_file):
    storage, path = data_file
    calls, seen = _recording(monkeypatch, path, fail_first=True)
    storage.prefetch("data.bin", [(0, 8 << 20)])
    storage.prefetch("data.bin", [(4096, 16 << 20)])
    assert seen.wait(10)
    assert calls == [("failed", [], "shardkit-read-ahead"), (path, [(4096, 16 << 20)], "shardkit-read-ahead")]


def test_hints_for_a_missing_file_are_dropped_without_an_error(tmp_path):
    storage = Storage(str(tmp_path))
    storage.prefetch("missing.bin", [(0, 4096)])
    storage.prefetch("missing.bin", [(0, 8 << 20)])  # on the thread: nothing to raise to anyone


def test_a_loads_hints_of_several_files_reach_the_thread_in_one_hand_over_in_order(monkeypatch, data_file):
    storage, path = data_file
    calls, _ = _recording(monkeypatch, path)
    handed: list[list[tuple[str, list[tuple[int, int]]]]] = []

    class Thread:  # the hinting thread's door: what is handed over, and how often
        def put(self, hints):
            handed.append([(name, list(ranges)) for name, ranges in hints])

    monkeypatch.setattr(read_ahead, "read_ahead_thread", type("One", (), {"get": lambda self: Thread()})())
    storage.prefetch_files([("data.bin", [(0, 4096)]), ("data.bin", [(0, 8 << 20)]),
                            ("data.bin", [(1 << 20, 16 << 20)])])
    assert [ranges for _, ranges, _ in calls] == [[(0, 4096)]]  # the header-sized hint, given by the caller
    assert handed == [[(path, [(0, 8 << 20)]), (path, [(1 << 20, 16 << 20)])]]  # the data's, in one go
