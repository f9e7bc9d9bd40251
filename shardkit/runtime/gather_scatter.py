"""The two collectives of a group, with their copy-in and copy-out.

Functions over tensors and process groups only: they know nothing of
modules, hooks or training states, so each can be tested on its own.

Note [rank-major layout]
    A group of parameters with padded shard sizes ``n_0 .. n_k`` all-gathers
    one flat tensor of ``W * N`` elements (``N = sum n_i``), laid out
    ``[r0: p0|p1|..][r1: p0|p1|..]..``.  Each parameter's rows are therefore
    strided across the rank blocks and must be copied out into its own
    contiguous buffer (``split_with_sizes_copy`` over the ``(W, N)`` view).
    The reduce-scatter input uses the same layout, built by ``chunk_cat``,
    which pads each gradient's dim 0 to a multiple of ``W`` with zeros, so the
    padded rows of every sharded gradient are exactly zero.

Note [SUM, then divide]
    Gloo's ``ReduceOp.AVG`` for reduce-scatter summed without dividing until
    torch 2.13, and ``PREMUL_SUM`` does not exist on gloo at all.  We always
    reduce with ``SUM`` and divide ourselves: by the data-parallel size after
    the reduction for fp32/bf16, split into a power of two before and the rest
    after for fp16 (so the sum cannot overflow), and by a user factor before.
    With ``set_force_sum_reduction_for_comms(True)`` a user factor is applied
    where torch's force-sum path applies it: after the SUM (split for fp16),
    exactly like the data-parallel size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "AllGatherPlan",
    "plan_all_gather",
    "all_gather_copy_in",
    "all_gather_copy_out",
    "issue_all_gather",
    "reduce_scatter_copy_in",
    "divide_factors",
    "reduce_scatter",
    "all_reduce",
]

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
chunk_cat = getattr(torch, "_chunk_cat", None)
_split_with_sizes_copy = getattr(torch, "split_with_sizes_copy", None)

_BYTE_ALIGN = 8  # segment alignment when a group mixes dtypes (viewed as bytes)


@dataclass(frozen=True)
class AllGatherPlan:
    """How one rank's inputs sit in the flat all-gather buffer.

    ``dtype`` is the collective's dtype: the parameters' compute dtype, or
    ``uint8`` when a group mixes dtypes (then every segment is padded to 8
    bytes so each can be viewed back as its own dtype)."""

    dtype: torch.dtype
    param_dtypes: tuple[torch.dtype, ...]
    numels: tuple[int, ...]      # elements each parameter contributes, in its own dtype
    segments: tuple[int, ...]    # the same, in units of ``dtype`` (padded in byte mode)
    per_rank: int                # sum of segments

    @property
    def byte_mode(self) -> bool:
        return self.dtype == torch.uint8 and any(d != torch.uint8 for d in self.param_dtypes)


def plan_all_gather(numels: list[int], dtypes: list[torch.dtype]) -> AllGatherPlan:
    if len(set(dtypes)) <= 1:
        return AllGatherPlan(dtypes[0], tuple(dtypes), tuple(numels), tuple(numels), sum(numels))
    segments = tuple(math.ceil(n * d.itemsize / _BYTE_ALIGN) * _BYTE_ALIGN for n, d in zip(numels, dtypes))
    return AllGatherPlan(torch.uint8, tuple(dtypes), tuple(numels), segments, sum(segments))


@torch.no_grad()
def all_gather_copy_in(inputs: list[torch.Tensor], plan: AllGatherPlan, out: torch.Tensor,
                       rank: int) -> torch.Tensor:
    """Copy (and cast) each input into this rank's block of ``out``; return the block.

    The block *is* the all-gather input: gathering into the same buffer needs
    no separate send tensor."""
    block = out.narrow(0, rank * plan.per_rank, plan.per_rank)
    if not plan.byte_mode:
        torch._foreach_copy_(list(torch.split(block, plan.segments)), inputs)
        return block
    offset = 0
    for tensor, numel, dtype, segment in zip(inputs, plan.numels, plan.param_dtypes, plan.segments):
        block.narrow(0, offset, numel * dtype.itemsize).view(dtype).copy_(tensor)
        offset += segment
    return block


def issue_all_gather(out: torch.Tensor, block: torch.Tensor, group: dist.ProcessGroup,
                     async_op: bool) -> dist.Work | None:
    return _all_gather_flat(out, block, group=group, async_op=async_op)


@torch.no_grad()
def all_gather_copy_out(out: torch.Tensor, plan: AllGatherPlan, world: int,
                        dests: list[torch.Tensor], chunk_shapes: list[torch.Size | None]) -> None:
    """Scatter the rank-major ``out`` into each parameter's ``(world, ...)`` destination.

    ``chunk_shapes[i]`` is ``None`` for a plain ``(world, n_i)`` destination, or
    the per-rank chunk shape when the destination is a strided view (a
    parameter sharded on a dim other than 0)."""
    rows = out.view(world, -1)
    if not plan.byte_mode and _split_with_sizes_copy is not None and all(s is None for s in chunk_shapes):
        _split_with_sizes_copy(rows, list(plan.segments), dim=1, out=dests)
        return
    offset = 0
    for dest, shape, numel, dtype, segment in zip(dests, chunk_shapes, plan.numels, plan.param_dtypes,
                                                  plan.segments):
        if plan.byte_mode:
            piece = rows.narrow(1, offset, numel * dtype.itemsize).view(dtype)
        else:
            piece = rows.narrow(1, offset, numel)
        if shape is not None:
            piece = piece.view((world, *shape))
        dest.copy_(piece)
        offset += segment


@torch.no_grad()
def reduce_scatter_copy_in(grads: list[torch.Tensor], shard_dims: list[int], padded_numels: list[int],
                           world: int, out: torch.Tensor) -> None:
    """Lay ``grads`` out rank-major in ``out`` (``world * sum(padded_numels)``
    elements), zero-padding dim 0 and casting to ``out``'s dtype."""
    rows = out.view(world, -1)
    same_dtype = all(g.dtype == grads[0].dtype for g in grads)
    if chunk_cat is not None and same_dtype and all(d == 0 for d in shard_dims):
        chunk_cat(grads, 0, world, out=rows)
        return
    offset = 0
    for grad, dim, numel in zip(grads, shard_dims, padded_numels):
        dest = rows.narrow(1, offset, numel)
        offset += numel
        if dim != 0:  # even division: chunk r of dim ``dim`` goes to row r
            size = list(grad.shape)
            split = size[:dim] + [world, size[dim] // world] + size[dim + 1:]
            chunk = size[:dim] + [size[dim] // world] + size[dim + 1:]
            dest.view((world, *chunk)).copy_(grad.view(split).movedim(dim, 0))
            continue
        per_rank_rows = -(-grad.shape[0] // world)
        tail = grad.shape[1:]
        blocks = dest.view((world, per_rank_rows, *tail))
        full, rem = divmod(grad.shape[0], per_rank_rows)
        if full:
            blocks[:full].copy_(grad[: full * per_rank_rows].view((full, per_rank_rows, *tail)))
        if full < world:
            blocks[full:].zero_()
            if rem:
                blocks[full, :rem].copy_(grad[full * per_rank_rows:])


def divide_factors(data_parallel_size: int, dtype: torch.dtype, custom_factor: float | None,
                   force_sum: bool = False) -> tuple[float, float]:
    """``(pre, post)``: divide the input by ``pre`` before the SUM and the
    output by ``post`` after it (see Note [SUM, then divide])."""
    if custom_factor is not None and not force_sum:
        return float(custom_factor), 1.0
    n = data_parallel_size if custom_factor is None else custom_factor
    if n == 1:
        return 1.0, 1.0
    if dtype == torch.float16:
        pre = 1
        while n % (pre * 2) == 0 and pre * pre < n:
            pre *= 2
        return float(pre), n / pre
    return 1.0, float(n)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                   op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False) -> dist.Work | None:
    return _reduce_scatter_flat(out, inp, op=op, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
