"""Copy-in, copy-out and the reduce layout on their own, in one process.

An all-gather is simulated by letting each of ``W`` "ranks" copy its inputs
into its own block of one flat buffer; a reduce-scatter by summing the laid
out inputs of all ranks and reading each rank's block.  The real collectives
only move those blocks, so this pins down every layout rule exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.runtime import gather_scatter as C


def _shards(full: torch.Tensor, world: int, dim: int) -> list[torch.Tensor]:
    """Each rank's padded shard, flattened: what the runtime all-gathers."""
    rows = math.ceil(full.shape[dim] / world)
    out = []
    for rank in range(world):
        padded_size = list(full.shape)
        padded_size[dim] = rows
        padded = torch.zeros(padded_size, dtype=full.dtype)
        real = max(0, min(rows, full.shape[dim] - rank * rows))
        if real:
            padded.narrow(dim, 0, real).copy_(full.narrow(dim, rank * rows, real))
        out.append(padded.reshape(-1))
    return out


def _gather_and_copy_out(fulls, dims, world):
    dtypes = [t.dtype for t in fulls]
    per_rank = [_shards(t, world, d) for t, d in zip(fulls, dims)]
    plan = C.plan_all_gather([s[0].numel() for s in per_rank], dtypes)
    out = torch.empty(world * plan.per_rank, dtype=plan.dtype)
    for rank in range(world):
        C.all_gather_copy_in([s[rank] for s in per_rank], plan, out, rank)
    buffers, dests, shapes = [], [], []
    for t, d, n in zip(fulls, dims, plan.numels):
        buffer = torch.empty(world * n, dtype=t.dtype)
        buffers.append(buffer)
        if d == 0:
            dests.append(buffer.view(world, -1))
            shapes.append(None)
        else:
            size = list(t.shape)
            split = size[:d] + [world, size[d] // world] + size[d + 1:]
            dests.append(buffer.view(split).movedim(d, 0))
            chunk = list(size)
            chunk[d] //= world
            shapes.append(torch.Size(chunk))
    C.all_gather_copy_out(out, plan, world, dests, shapes)
    return plan, [b[: t.numel()].view(t.shape) for b, t in zip(buffers, fulls)]


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 5), rows=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       tail=st.integers(1, 3))
def test_all_gather_round_trip_rebuilds_uneven_parameters(world, rows, tail):
    fulls = [torch.randn(r, tail) for r in rows]
    plan, rebuilt = _gather_and_copy_out(fulls, [0] * len(fulls), world)
    assert not plan.byte_mode
    for full, got in zip(fulls, rebuilt):
        assert torch.equal(full, got)


def test_mixed_dtypes_and_a_dim1_shard_round_trip_through_bytes():
    fulls = [torch.randn(5, 3), torch.randn(3).to(torch.bfloat16), torch.randn(2, 4), torch.arange(7.0).double()]
    plan, rebuilt = _gather_and_copy_out(fulls, [0, 0, 1, 0], 2)
    assert plan.byte_mode and all(seg % 8 == 0 for seg in plan.segments)
    for full, got in zip(fulls, rebuilt):
        assert got.dtype == full.dtype and torch.equal(full, got)


def _reduce(grads, dims, world, force_fallback):
    numels = [_shards(g, world, d)[0].numel() for g, d in zip(grads, dims)]
    inp = torch.empty(world * sum(numels), dtype=torch.float64)
    saved = C.chunk_cat
    if force_fallback:
        C.chunk_cat = None
    try:
        C.reduce_scatter_copy_in(grads, dims, numels, world, inp)
    finally:
        C.chunk_cat = saved
    return inp.view(world, -1), numels


@pytest.mark.parametrize("force_fallback", [False, True], ids=["chunk_cat", "plain_torch"])
def test_reduce_layout_puts_each_ranks_rows_in_its_block_with_zero_padding(force_fallback):
    world = 3
    grads = [torch.randn(7, 2), torch.randn(2), torch.randn(4, 6)]
    dims = [0, 0, 1] if force_fallback else [0, 0, 0]
    blocks, numels = _reduce(grads, dims, world, force_fallback)
    for rank in range(world):
        offset = 0
        for g, d, n in zip(grads, dims, numels):
            expected = _shards(g.double(), world, d)[rank]
            assert torch.equal(blocks[rank, offset:offset + n], expected), (rank, d)
            offset += n


def test_divide_factors_split_fp16_and_honour_a_custom_factor():
    assert C.divide_factors(1, torch.float32, None) == (1.0, 1.0)
    assert C.divide_factors(8, torch.float32, None) == (1.0, 8.0)
    assert C.divide_factors(8, torch.bfloat16, None) == (1.0, 8.0)
    pre, post = C.divide_factors(16, torch.float16, None)
    assert pre * post == 16 and pre > 1 and post > 1  # neither the sum nor the inputs overflow alone
    assert C.divide_factors(8, torch.float32, 2.0) == (2.0, 1.0)
