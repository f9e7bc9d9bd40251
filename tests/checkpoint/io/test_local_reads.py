"""A load's reads from a local disk: each I/O thread reads one run of the data front to back, each file
through one open descriptor, so the kernel reads ahead of the reads and their checksums.

A descriptor per read step (open, ``preadv``, close) restarted the kernel's read-ahead at every step; the
reads now keep their file open inside ``LocalDisk.files_held_open``, and no descriptor outlives it.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.checkpoint.formats.native import chunk_reads
from shardkit.checkpoint.io import local_disk
from shardkit.checkpoint.io.local_disk import LocalDisk
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CorruptCheckpoint


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _count_data_opens(monkeypatch) -> list[str]:
    """Paths of the data files ``local_disk`` opens with ``os.open`` for reads (hints are switched off)."""
    opened: list[str] = []
    real_open = os.open

    def counting(path, flags, *args, **kwargs):
        if "/data/" in str(path) and not flags & (os.O_WRONLY | os.O_RDWR):
            opened.append(str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(local_disk.os, "open", counting)
    monkeypatch.setattr(LocalDisk, "prefetch_files", lambda self, hints: None)
    return opened


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_local_load_opens_each_data_file_once_per_io_thread_however_many_steps_it_reads(tmp_path, monkeypatch):
    state = {f"w{i}": torch.randn(64, 1024) for i in range(6)}  # 6 x 256 KiB, in one data file
    url = str(tmp_path / "ck")
    skc.save(state, url)
    steps: list[int] = []
    read_parts = Storage.read_parts

    def counted(self, name, start, parts):
        if name.startswith("data/"):
            steps.append(sum(p.numel() for p in parts))
        return read_parts(self, name, start, parts)

    monkeypatch.setattr(Storage, "read_parts", counted)
    monkeypatch.setattr(chunk_reads, "STEP_BYTES", 16 << 10)  # many steps per request
    opened = _count_data_opens(monkeypatch)
    before = _open_fds()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    skc.load(target, url, io_threads=2)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert sum(steps) == 6 * 64 * 1024 * 4 and len(steps) >= 6 * 16  # every byte once, in small steps
    assert len(set(opened)) == 1 and len(opened) <= 2, opened  # one descriptor per run (2 threads), not per step
    assert _open_fds() == before  # none left open


def test_files_held_open_reuses_one_descriptor_per_file_closes_it_on_leaving_and_nests(tmp_path):
    (tmp_path / "a.bin").write_bytes(bytes(range(256)) * 16)
    (tmp_path / "b.bin").write_bytes(bytes(range(255, -1, -1)) * 16)
    disk = LocalDisk(lambda what, fn: fn())
    out = [torch.empty(256, dtype=torch.uint8) for _ in range(4)]
    before = _open_fds()
    with disk.files_held_open():
        disk.read_parts(str(tmp_path / "a.bin"), "reading a", 0, [out[0]], "a is truncated")
        assert _open_fds() == before + 1
        with disk.files_held_open():  # nested: the same held file, still held when the inner block ends
            disk.read_parts(str(tmp_path / "a.bin"), "reading a", 256, [out[1]], "a is truncated")
        assert _open_fds() == before + 1
        disk.read_parts(str(tmp_path / "b.bin"), "reading b", 0, [out[2]], "b is truncated")  # a closed, b held
        assert _open_fds() == before + 1
    assert _open_fds() == before
    disk.read_parts(str(tmp_path / "a.bin"), "reading a", 512, [out[3]], "a is truncated")  # outside: open, close
    assert _open_fds() == before
    assert torch.equal(out[0], torch.arange(256, dtype=torch.uint8)) and torch.equal(out[1], out[0])
    assert torch.equal(out[2], torch.arange(255, -1, -1).to(torch.uint8)) and torch.equal(out[3], out[0])


def test_a_held_read_past_the_end_fails_as_truncated_and_leaves_no_descriptor(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 100)
    disk = LocalDisk(lambda what, fn: fn())
    before = _open_fds()
    with pytest.raises(CorruptCheckpoint, match="a is truncated"):
        with disk.files_held_open():
            disk.read_parts(str(tmp_path / "a.bin"), "reading a", 50, [torch.empty(100, dtype=torch.uint8)],
                            "a is truncated")
    assert _open_fds() == before


def test_a_failed_held_read_is_retried_through_a_fresh_descriptor(tmp_path, monkeypatch):
    (tmp_path / "a.bin").write_bytes(bytes(range(256)))
    attempts: list[int] = []
    real = os.preadv

    def flaky(fd, buffers, offset, *args):
        attempts.append(fd)
        if len(attempts) == 1:
            raise OSError(5, "Input/output error")
        return real(fd, buffers, offset, *args)

    def retry(what, fn):
        try:
            return fn()
        except OSError:
            return fn()

    disk = LocalDisk(retry)
    out = torch.empty(256, dtype=torch.uint8)
    before = _open_fds()
    with disk.files_held_open():
        monkeypatch.setattr(local_disk.os, "preadv", flaky)
        disk.read_parts(str(tmp_path / "a.bin"), "reading a", 0, [out], "a is truncated")
        monkeypatch.undo()
        assert _open_fds() == before + 1  # the failed descriptor closed, the fresh one held
    assert len(attempts) == 2 and torch.equal(out, torch.arange(256, dtype=torch.uint8))
    assert _open_fds() == before


def test_a_hold_is_this_threads_alone(tmp_path):
    (tmp_path / "a.bin").write_bytes(bytes(range(256)))
    disk = LocalDisk(lambda what, fn: fn())
    before = _open_fds()
    with disk.files_held_open():
        out = torch.empty(256, dtype=torch.uint8)
        thread = threading.Thread(target=disk.read_parts,
                                  args=(str(tmp_path / "a.bin"), "reading a", 0, [out], "a is truncated"))
        thread.start()
        thread.join()
        assert _open_fds() == before  # the other thread's read opened and closed its own descriptor
    assert torch.equal(out, torch.arange(256, dtype=torch.uint8))


@pytest.mark.parametrize("sizes, lanes, expected", [
    ([1] * 10, 2, [(0, 5), (5, 10)]),
    ([10, 1, 1, 1], 2, [(0, 1), (1, 4)]),
    ([3, 3, 3, 3], 2, [(0, 2), (2, 4)]),
    ([5], 4, [(0, 1)]),
    ([], 2, []),
    ([1, 1, 1], 8, [(0, 1), (1, 2), (2, 3)]),
    ([1, 2, 3], 1, [(0, 3)]),
])
def test_the_reads_are_cut_into_consecutive_runs_of_about_equal_bytes_one_per_thread(sizes, lanes, expected):
    assert chunk_reads.read_runs(sizes, lanes) == expected
