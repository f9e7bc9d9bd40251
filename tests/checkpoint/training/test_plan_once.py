"""A load works out each read once: one validation and one ``byte_runs`` per request, one
``local_pieces`` per target -- whichever passes (check, stage, read, host rounds) see the request.

The counts are taken by wrapping the functions wherever the package imported them, keyed by what
they were asked (a request's key, chunk and box; a chunk box and sub-box; a target's key).
"""

from __future__ import annotations

import sys
import uuid
from collections import Counter

import pytest
import torch

import shardkit.checkpoint as skc
import shardkit.checkpoint.training.load  # noqa: F401 - imported before any count is taken
from shardkit.checkpoint.formats.base import plan_reads
from shardkit.checkpoint.formats.native.reader import NativeReader
from shardkit.checkpoint.geometry import placements, plan
from shardkit.checkpoint.training.device_reads import read_requests
from tests.support.dist import run_on_ranks

SHAPES = {"embed": (24, 16), "layer.w": (48, 8), "layer.b": (300,), "norm": (12, 4, 8)}  # 1.5 kB each


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {key: torch.randn(shape, generator=gen) for key, shape in SHAPES.items()}


class CallCounts:
    """Calls of wrapped functions, counted by ``key(*args)`` -- what each call was asked."""

    def __init__(self, key) -> None:
        self.key = key
        self.calls: Counter = Counter()

    def wrap(self, function):
        def counted(*args, **kwargs):
            self.calls[self.key(*args)] += 1
            return function(*args, **kwargs)
        return counted

    def everywhere(self, monkeypatch: pytest.MonkeyPatch, function) -> "CallCounts":
        """Wrap ``function`` in every module of the package that imported it, whichever module calls it
        (not where it is defined: a module imported meanwhile would keep the wrapper)."""
        for name, module in list(sys.modules.items()):
            if (name.startswith("shardkit.") and name != function.__module__
                    and getattr(module, function.__name__, None) is function):
                monkeypatch.setattr(module, function.__name__, self.wrap(function))
        return self


def _count_planning(monkeypatch: pytest.MonkeyPatch) -> tuple[CallCounts, CallCounts, CallCounts]:
    """Counters of ``NativeReader._validate`` per request (key, chunk, box), ``byte_runs`` per
    (chunk box, sub-box), ``local_pieces`` per target key."""
    validated = CallCounts(lambda reader, r: (r.fqn, r.chunk, r.box))
    monkeypatch.setattr(NativeReader, "_validate", validated.wrap(NativeReader._validate))
    runs = CallCounts(lambda chunk_box, sub, itemsize: (chunk_box, sub)).everywhere(monkeypatch, plan.byte_runs)
    pieces = CallCounts(lambda tensor, fqn="": fqn).everywhere(monkeypatch, placements.local_pieces)
    return validated, runs, pieces


def _stored_chunks(url: str) -> tuple[dict, dict]:
    """Every stored chunk as the (key, chunk, box) of a request reading it whole, and its (chunk box, box)."""
    entries = NativeReader(url).tensors()
    whole = {(key, i, c.box) for key, e in entries.items() for i, c in enumerate(e.chunks)}
    return ({request: 1 for request in whole}, {(box, box): 1 for _, _, box in whole})


@pytest.mark.parametrize("where", ["local", "remote"])
@pytest.mark.parametrize("verify_first", [False, True], ids=["one_pass", "verify_first"])
def test_a_load_of_targets_stored_in_several_chunks_plans_each_request_once(tmp_path, monkeypatch, where,
                                                                            verify_first):
    url = str(tmp_path / "ck") if where == "local" else f"memory://plan-once-{uuid.uuid4().hex[:8]}"
    saved = _tensors()
    skc.save(saved, url, chunk_bytes=1024, block_bytes=256)  # every target needs pieces of 2 chunks
    want_requests, want_runs = _stored_chunks(url)
    assert len(want_requests) == 8
    validated, runs, pieces = _count_planning(monkeypatch)
    targets = {key: torch.zeros(shape) for key, shape in SHAPES.items()}
    skc.load(targets, url, verify_first=verify_first, staging_bytes=1 << 20)
    assert all(torch.equal(targets[key], saved[key]) for key in SHAPES)
    assert dict(validated.calls) == want_requests
    assert dict(runs.calls) == want_runs
    assert dict(pieces.calls) == {key: 1 for key in SHAPES}


def test_a_target_on_another_device_is_read_in_host_rounds_with_the_plans_prepare_made(tmp_path, monkeypatch):
    skc.save(_tensors(), str(tmp_path / "ck"), chunk_bytes=1024, block_bytes=256)
    want_requests, want_runs = _stored_chunks(str(tmp_path / "ck"))
    validated, runs, _ = _count_planning(monkeypatch)
    reader = NativeReader(str(tmp_path / "ck"))
    # meta stands in for a GPU: its requests go through page-locked-style host rounds, a new request each
    outs = {key: torch.empty(shape, device="meta") for key, shape in SHAPES.items()}
    requests = plan_reads(reader, [(key, ((0,) * len(shape), shape), outs[key]) for key, shape in SHAPES.items()])
    reader.prepare(requests)
    reader.verify(requests)
    read_requests(reader, requests, round_bytes=1024)  # one round per chunk
    assert reader.stats.requests == 8
    assert dict(validated.calls) == want_requests
    assert dict(runs.calls) == want_runs


def _save_rows_load_columns(url: str, verify_first: bool) -> dict:
    """Save each matrix row-sharded over 2 ranks, load it column-sharded: every rank's target is a
    column cut of both stored chunks (several byte runs each, so the staged path)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = {key: t for key, t in _tensors().items() if t.dim() == 2}
    skc.save({key: distribute_tensor(t, mesh, [Shard(0)]) for key, t in full.items()}, url, block_bytes=64)
    dist.barrier()
    monkeypatch = pytest.MonkeyPatch()
    try:
        validated, runs, pieces = _count_planning(monkeypatch)
        targets = {key: distribute_tensor(torch.zeros(t.shape), mesh, [Shard(1)]) for key, t in full.items()}
        skc.load(targets, url, verify_first=verify_first)
    finally:
        monkeypatch.undo()
    return {"equal": all(torch.equal(targets[key].full_tensor(), full[key]) for key in full),
            "validated": dict(validated.calls), "runs": dict(runs.calls), "pieces": dict(pieces.calls)}


@pytest.mark.parametrize("verify_first", [False, True], ids=["one_pass", "verify_first"])
def test_a_resharded_column_cut_load_plans_each_request_once_on_every_rank(tmp_path, verify_first):
    out = run_on_ranks(2, _save_rows_load_columns, str(tmp_path / "ck"), verify_first)
    for rank, got in enumerate(out):
        assert got["equal"]
        assert got["pieces"] == {"embed": 1, "layer.w": 1}
        # this rank's half of the columns of each stored half of the rows
        cuts = {("embed", ((rows, 8 * rank), (12, 8))) for rows in (0, 12)}
        cuts |= {("layer.w", ((rows, 4 * rank), (24, 4))) for rows in (0, 24)}
        assert sorted(got["validated"].values()) == [1, 1, 1, 1]
        assert {(key, box) for key, _, box in got["validated"]} == cuts
        assert sorted(got["runs"].values()) == [1, 1, 1, 1]
        assert {sub for _, sub in got["runs"]} == {box for _, box in cuts}


def test_a_reader_keeps_a_bounded_number_of_plans_and_still_reads_every_request(tmp_path, monkeypatch):
    from shardkit.checkpoint.formats.native import reader as native

    saved = _tensors()
    skc.save(saved, str(tmp_path / "ck"), chunk_bytes=1024, block_bytes=256)
    monkeypatch.setattr(native, "MAX_PLANS", 3)
    validated, _, _ = _count_planning(monkeypatch)
    reader = NativeReader(str(tmp_path / "ck"))
    for _ in range(2):
        outs = {key: torch.zeros(shape) for key, shape in SHAPES.items()}
        requests = plan_reads(reader, [(key, ((0,) * len(shape), shape), outs[key]) for key, shape in SHAPES.items()])
        reader.read(requests)
        assert all(torch.equal(outs[key], saved[key]) for key in SHAPES)
        assert len(reader._plans) <= 3
    assert sum(validated.calls.values()) == 16  # 8 requests, twice: the plans were dropped and made again


def test_a_request_whose_box_holds_lists_is_planned_and_read(tmp_path):
    from shardkit.checkpoint.formats.base import ReadRequest

    saved = _tensors()
    skc.save(saved, str(tmp_path / "ck"))
    out = torch.zeros(4, 16)
    reader = NativeReader(str(tmp_path / "ck"))
    reader.read([ReadRequest("embed", 0, ([2, 0], [4, 16]), out)])
    assert torch.equal(out, saved["embed"][2:6])
