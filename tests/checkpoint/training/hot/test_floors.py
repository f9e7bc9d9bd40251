"""The hot tier benchmark's floors (benchmarks/peers_hot_floors.py) do the raw work of their recoveries: the
local floor lands every byte of a rank's own copy in memory of the copy's size -- not in a small reused
buffer that stays in the CPU's cache -- and refuses a buffer the copy does not fit."""

from __future__ import annotations

import os
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "benchmarks")


@pytest.fixture
def floors(monkeypatch):
    monkeypatch.syspath_prepend(os.path.abspath(BENCHMARKS))  # the benchmark imports its neighbours by name
    import peers_hot_floors

    yield peers_hot_floors
    sys.modules.pop("peers_hot_floors", None)


def _copy(root, rank: int, step: int, sizes: dict[str, int]) -> list[bytes]:
    """A complete step holding rank ``rank``'s copy, its files of ``sizes`` bytes (distinct bytes each)."""
    step_dir = root / "run-000000000001" / f"step-{step:010d}"
    (step_dir / f"rank-{rank}.aaaaaaaaaaaa000001").mkdir(parents=True)
    (step_dir / "complete.json").write_text("{}")
    written = []
    for i, (name, size) in enumerate(sorted(sizes.items())):
        data = bytes((i * 7 + k) % 251 for k in range(size))
        (step_dir / f"rank-{rank}.aaaaaaaaaaaa000001" / name).write_bytes(data)
        written.append(data)
    return written


def test_the_local_floor_reads_every_byte_of_the_own_copy_into_a_buffer_of_its_size(tmp_path, floors):
    written = _copy(tmp_path, 1, 3, {"state.bin": 70_001, "manifest.json": 513})
    files = floors.own_copy_files(str(tmp_path), 1)
    into = floors.local_buffer(files)
    assert into.numel() == 70_514
    assert floors.read_files(files, into) == 70_514
    assert bytes(into.numpy()) == b"".join(written)  # manifest.json, then state.bin: the files in name order
    assert floors.read_files_reused(files) == 70_514  # the narrower figure reads the same bytes


def test_the_local_floor_refuses_a_buffer_the_copy_does_not_fit(tmp_path, floors):
    _copy(tmp_path, 0, 2, {"state.bin": 4096, "manifest.json": 100})
    files = floors.own_copy_files(str(tmp_path), 0)
    with pytest.raises(SystemExit, match="too small"):
        floors.read_files(files, torch.empty(4000, dtype=torch.uint8))


def test_the_local_floor_reads_the_newest_complete_step_only(tmp_path, floors):
    _copy(tmp_path, 0, 2, {"state.bin": 10})
    (tmp_path / "run-000000000001" / "step-0000000009" / "rank-0.aaaaaaaaaaaa000002").mkdir(parents=True)
    found = floors.own_copy_files(str(tmp_path), 0)  # step 9 was never completed
    assert [os.path.basename(os.path.dirname(os.path.dirname(f))) for f in found] == ["step-0000000002"]
