"""Loads from a (dp=2, tp=2) checkpoint read at most 10 % more than they need, strided layouts included.

A larger ``TPNet`` (vocab 1001, dim 128, hidden 517: ~6 MB of model and AdamW
state) is saved by torch's runtime at (2, 2) with 4 KiB checksum blocks and
loaded into every layout of the matrix, and into a layout where each rank
holds several row ranges (``(_StridedShard(0, sf=2), Replicate())``).  Bytes
fetched from storage are counted per tensor by the native reader.

What does not hold: a target that cuts the *columns* of a stored chunk more
finely than it was saved (RowwiseParallel's ``w2`` weight, ``Shard(1)`` over
tp=2, loaded at tp=4) fetches whole checksum blocks of every row it needs, so
that tensor reads about 2.5x what it needs; checksums are per block of the
row-major chunk.  The test pins that down instead of hiding it.
"""

from __future__ import annotations

import pytest

from tests.checkpoint_2d_helpers import LAYOUTS, build, optimizer, run_layout
from tests.dist import run_on_ranks

BIG = (1001, 128, 517)


def _save_big(url: str) -> None:
    import shardkit.checkpoint as skc

    model = build("torch", LAYOUTS["dp2tp2"], 0, BIG)
    opt = optimizer(model)
    skc.save(skc.get_state_dict(model, opt), url, chunk_bytes=64 << 10, block_bytes=4 << 10)


def _read_per_tensor(url: str, sd: dict, strict: bool = True) -> dict[str, tuple[int, int]]:
    """``load``'s reads of ``sd`` from ``url``, per key: (bytes fetched, bytes needed)."""
    from shardkit.checkpoint.formats import open_reader
    from shardkit.checkpoint.state.tree import flatten
    from shardkit.checkpoint.training.load import plan_load

    out = {}
    with open_reader(url) as reader:
        requests = plan_load(reader, flatten(sd), strict).requests
        for key in sorted({r.fqn for r in requests}):
            before = reader.stats.bytes_read, reader.stats.bytes_needed
            reader.read([r for r in requests if r.fqn == key])
            out[key] = (reader.stats.bytes_read - before[0], reader.stats.bytes_needed - before[1])
    return out


def _load_big(url: str, runtime: str, layout: str) -> dict[str, tuple[int, int]]:
    import shardkit.checkpoint as skc

    model = build(runtime, LAYOUTS[layout], 1, BIG)
    return _read_per_tensor(url, skc.get_state_dict(model, optimizer(model)))


def _load_big_into_strided_row_ranges(url: str) -> dict[str, tuple[int, int]]:
    """Model tensors into ``(_StridedShard(0, sf=2), Replicate())`` on (2, 2): two row ranges per rank."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardkit.checkpoint.formats import open_reader

    mesh = init_device_mesh("cpu", (2, 2))
    with open_reader(url) as reader:
        shapes = {k: e.shape for k, e in reader.tensors().items() if k.startswith("model.") and len(e.shape)}
    sd = {k: distribute_tensor(torch.zeros(s), mesh, [_StridedShard(0, split_factor=2), Replicate()],
                               src_data_rank=None) for k, s in shapes.items()}
    return _read_per_tensor(url, sd, strict=False)


def _totals(per_rank: list[dict[str, tuple[int, int]]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rank in per_rank:
        for key, (read, needed) in rank.items():
            acc = out.setdefault(key, [0, 0])
            acc[0] += read
            acc[1] += needed
    return out


@pytest.fixture(scope="module")
def big_2d(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("amp") / "dp2tp2")
    run_on_ranks(4, _save_big, url)
    return url


def _amplification(per_key: dict[str, list[int]], keep=lambda key: True) -> float:
    read = sum(v[0] for k, v in per_key.items() if keep(k))
    needed = sum(v[1] for k, v in per_key.items() if keep(k))
    return read / needed


@pytest.mark.parametrize("runtime,layout", [("torch", "dp4tp1"), ("torch", "dp1tp2"), ("shardkit", "fsdp3"),
                                            ("torch", "hsdp1x2tp2"), ("torch", "plain")])
def test_loads_that_cut_rows_read_at_most_ten_percent_more(big_2d, runtime, layout):
    per_key = _totals([run_layout(layout, _load_big, big_2d, runtime, layout)] if layout == "plain" else
                      run_on_ranks(LAYOUTS[layout].world, _load_big, big_2d, runtime, layout))
    assert _amplification(per_key) <= 1.1, (layout, _amplification(per_key))


def test_strided_targets_holding_several_row_ranges_read_at_most_ten_percent_more(big_2d):
    per_key = _totals(run_on_ranks(4, _load_big_into_strided_row_ranges, big_2d))
    assert len(per_key) == 16  # every model tensor
    assert _amplification(per_key) <= 1.1, _amplification(per_key)


def test_tp4_reads_rows_within_ten_percent_and_pays_for_cutting_w2_columns(big_2d):
    per_key = _totals(run_on_ranks(4, _load_big, big_2d, "torch", "dp1tp4"))
    column_cut = lambda key: ".w2.weight" in key  # noqa: E731 - Shard(1) over tp: 2 stored -> 4 wanted
    assert _amplification(per_key, lambda k: not column_cut(k)) <= 1.1
    assert 2.0 <= _amplification(per_key, column_cut) <= 2.6  # whole blocks of every row it needs
