"""What a load costs besides its bytes: its collectives, its kernel hints, and what it asks of storage.

A default load at 2 ranks agrees on the outcome of its planning inside the
collective that decides who reads what, and a local load reads the few bytes
every rank holds (an optimizer's step counts) on each rank instead of sending
them: two collectives in all, no transfer.  A local load asks the kernel to
read every data file's header first and the data right after, once; the
resharding load in one process asks storage for the bytes it needs, each once.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

import shardkit.checkpoint as skc
from tests.support.dist import run_on_ranks

ROWS, COLS = 64, 16


@contextlib.contextmanager
def _counting() -> Iterator[list[int]]:
    """[collectives this rank arrived at, point-to-point transfers it made] within the block."""
    from shardkit.checkpoint.io.dist import Dist

    arrive, exchange = Dist.arrive, Dist.exchange
    counts = [0, 0]

    def counted_arrive(self, phase=None):
        counts[0] += 1
        return arrive(self, phase)

    def counted_exchange(self, ops):
        counts[1] += len(ops)
        return exchange(self, ops)

    Dist.arrive, Dist.exchange = counted_arrive, counted_exchange
    try:
        yield counts
    finally:
        Dist.arrive, Dist.exchange = arrive, exchange


def _state(fill: float | None) -> dict[str, torch.Tensor]:
    """``w`` sharded by rows over the ranks; ``steps``: plain scalars every rank holds (AdamW's step counts)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    out = {"w": distribute_tensor(full if fill is None else torch.full_like(full, fill), mesh, [Shard(0)])}
    for i in range(12):
        out[f"step{i}"] = torch.tensor(float(i + 1) if fill is None else fill)
    return out


def _save(url: str) -> None:
    skc.save(_state(None), url)


def _load_counting(url: str) -> tuple[int, int, bool]:
    """(collectives this rank arrived at, point-to-point transfers it made, whether it loaded bitwise)."""

    sd = _state(-1.0)
    with _counting() as counts:
        skc.load(sd, url)
    truth = _state(None)
    same = all(torch.equal(v.to_local() if hasattr(v, "to_local") else v,
                           truth[k].to_local() if hasattr(truth[k], "to_local") else truth[k]) for k, v in sd.items())
    return counts[0], counts[1], same


def test_a_default_two_rank_load_with_plain_step_counts_costs_two_collectives_and_no_transfer(tmp_path):
    url = str(tmp_path / "ck")
    run_on_ranks(2, _save, url)
    results = run_on_ranks(2, _load_counting, url)
    assert results == [(2, 0, True), (2, 0, True)]


def test_a_local_load_hints_every_header_before_the_data_and_each_range_once(tmp_path, monkeypatch):
    from shardkit.checkpoint.formats.native.reader import NativeReader
    from shardkit.checkpoint.io.storage import Storage

    url = str(tmp_path / "ck")
    saved = {"a": torch.randn(300, 40), "b": torch.randn(500, 8)}
    skc.save(saved, url, chunk_bytes=16 << 10)
    files = NativeReader(url).manifest.files
    hints: list[tuple[str, list[tuple[int, int]]]] = []
    prefetch_files = Storage.prefetch_files

    def recorded(self, batch):
        hints.extend((name, list(ranges)) for name, ranges in batch)
        prefetch_files(self, batch)

    monkeypatch.setattr(Storage, "prefetch_files", recorded)
    sd = {"a": torch.zeros(300, 40), "b": torch.zeros(500, 8)}
    skc.load(sd, url)
    assert all(torch.equal(sd[k], saved[k]) for k in saved)
    heads = [(name, ranges) for name, ranges in hints if ranges == [(0, files[name].header.size)]]
    assert sorted(name for name, _ in heads) == sorted(files)  # every file's header ...
    assert hints[:len(files)] == heads  # ... first
    data = hints[len(files):]
    assert sorted(name for name, _ in data) == sorted(files)  # then the data of each file, once
    for name, ranges in data:
        assert ranges == [(files[name].header.size, files[name].size)]  # every chunk of it is needed


def _save_for_one(url: str) -> None:
    skc.save({"w": _state(None)["w"], "v": _state(None)["w"]}, url, chunk_bytes=1024, block_bytes=256)


def test_the_resharding_load_in_one_process_asks_storage_for_each_needed_byte_once(tmp_path, monkeypatch):
    from shardkit.checkpoint.io.storage import Storage

    url = str(tmp_path / "ck")
    run_on_ranks(2, _save_for_one, url)
    asked: list[tuple[str, int, int]] = []
    read_parts = Storage.read_parts

    def counted(self, name, start, parts):
        asked.append((name, start, start + sum(p.numel() for p in parts)))
        return read_parts(self, name, start, parts)

    monkeypatch.setattr(Storage, "read_parts", counted)
    sd = {"w": torch.zeros(ROWS, COLS), "v": torch.zeros(ROWS, COLS)}
    skc.load(sd, url)
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    assert torch.equal(sd["w"], full) and torch.equal(sd["v"], full)
    data = [a for a in asked if a[0].startswith("data/")]
    assert sum(b - a for _, a, b in data) == 2 * math.prod(full.shape) * 4  # every byte needed, no more
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, a, b in data:
        by_file.setdefault(name, []).append((a, b))
    for spans in by_file.values():  # and none twice
        spans.sort()
        assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))


def _resume_counting(root: str) -> tuple[int, int, bool]:
    """(collectives, point-to-point transfers, whether the model came back bitwise) of a manager's resume."""
    from tests.support.checkpoint_helpers import build_model, make_optimizer, train

    model = build_model("shardkit", seed=1)
    opt = make_optimizer(model)
    train(model, opt, range(1))
    skc.CheckpointManager(root).save(1, model, opt)
    saved = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    fresh = build_model("shardkit", seed=2)
    fresh_opt = make_optimizer(fresh)
    with _counting() as counts:
        skc.CheckpointManager(root).load_latest(fresh, fresh_opt)
    same = all(torch.equal(v.to_local(), saved[k]) for k, v in fresh.state_dict().items())
    return counts[0], counts[1], same


def test_a_resume_at_two_ranks_reads_step_counts_and_rng_states_on_each_rank_in_four_collectives(tmp_path):
    # the steps to resume (rank 0 lists, all learn), the input state's check, and the load's two
    results = run_on_ranks(2, _resume_counting, str(tmp_path / "root"))
    assert results == [(4, 0, True), (4, 0, True)]


def test_a_native_load_reads_its_manifest_without_asking_storage_first_and_others_are_still_detected(
        tmp_path, monkeypatch):
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.errors import CheckpointNotFound

    url = str(tmp_path / "ck")
    skc.save({"a": torch.arange(6.0)}, url)
    asked: list[str] = []
    exists = Storage.exists
    monkeypatch.setattr(Storage, "exists", lambda self, name="": asked.append(name) or exists(self, name))
    sd = {"a": torch.zeros(6)}
    skc.load(sd, url)
    assert torch.equal(sd["a"], torch.arange(6.0)) and asked == []  # an object store's HEAD or list each
    torch.save({"a": torch.arange(6.0)}, tmp_path / "plain.pt")
    plain = {"model": {"a": torch.zeros(6)}}  # a torch.save file's keys are read as the model's
    skc.load(plain, str(tmp_path / "plain.pt"))  # not native: detected as before
    assert torch.equal(plain["model"]["a"], torch.arange(6.0))
    try:
        skc.load(sd, str(tmp_path / "nothing"))
    except CheckpointNotFound as exc:
        assert "no such file or directory" in str(exc)
    else:
        raise AssertionError("a path without a checkpoint loaded")


def _load_alone_counting(url: str) -> tuple[int, int, bool, bool]:
    """In a group of one (torchrun with one rank, as the resharding load of ``benchmarks/peers.py`` runs):
    (collectives arrived at, transfers made, whether it loaded bitwise, whether a process group exists)."""
    import torch.distributed as dist

    sd = {"w": torch.zeros(ROWS, COLS), "v": torch.zeros(ROWS, COLS)}
    with _counting() as counts:
        skc.load(sd, url)
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    return counts[0], counts[1], torch.equal(sd["w"], full) and torch.equal(sd["v"], full), dist.is_initialized()


def test_the_resharding_load_in_a_group_of_one_meets_no_collective(tmp_path):
    url = str(tmp_path / "ck")
    run_on_ranks(2, _save_for_one, url)
    assert run_on_ranks(1, _load_alone_counting, url) == [(0, 0, True, True)]
