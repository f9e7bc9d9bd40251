"""The reduction of one group's gradients after its backward: one reduce-scatter, then under HSDP one all-reduce.

What a group hands over is its unsharded gradients (:func:`take_unsharded_grads`);
what comes back is each parameter's sharded gradient, accumulated
(:func:`reduce_grads`).  Why a module of its own: this is the step's
communication peak and its memory peak at the root, with rules of its own --
the copy-in frees the unsharded gradients at once, older groups' reduction
buffers are released only as this one needs room, and HSDP's micro-batches
without the all-reduce (``set_requires_all_reduce(False)``) hold their
reduce-scattered sums per parameter until a micro-batch all-reduces them, the
set of parameters with gradients allowed to change between micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shardkit.runtime import debug as D
from shardkit.runtime import gather_scatter as C
from shardkit.runtime.comm_hooks import GroupComms
from shardkit.runtime.device_sync import CommContext
from shardkit.runtime.mesh_info import MeshInfo
from shardkit.runtime.sharded_param import ShardedParam

__all__ = ["HeldSums", "ReductionOptions", "take_unsharded_grads", "reduce_grads"]

HeldSums = dict[ShardedParam, torch.Tensor]
"""HSDP: each parameter's reduce-scattered gradient, summed over micro-batches and not all-reduced yet."""


@dataclass(frozen=True)
class ReductionOptions:
    """A group's knobs for this reduction (``FSDPModule.set_*``), read when its backward ends."""

    all_reduce: bool                 # under HSDP: all-reduce over the replicas now, or hold the sums
    divide_factor: float | None      # ``set_gradient_divide_factor``
    reduce_scatter_unused: bool      # ``set_reduce_scatter_unused_params``: zeros for unused parameters


def take_unsharded_grads(params: list[ShardedParam], options: ReductionOptions,
                         held: HeldSums) -> tuple[list[ShardedParam], list[torch.Tensor]]:
    """The unsharded gradients to reduce, taken off ``params``: the returned list holds the only references
    (:func:`reduce_grads` frees them early).  A parameter without a gradient takes part with zeros where the
    user asked for unused parameters to be reduce-scattered, or where an HSDP sum it holds must still be
    all-reduced now."""
    owners, grads = [], []
    for p in params:
        grad = p.take_unsharded_grad()
        if grad is None and options.reduce_scatter_unused and p.requires_grad and p.unsharded_param is not None:
            grad = p.zero_unsharded_grad()
        elif grad is None and options.all_reduce and p in held:
            grad = p.zero_unsharded_grad()
        if grad is not None:
            owners.append(p)
            grads.append(grad)
    return owners, grads


@torch.no_grad()
def reduce_grads(owners: list[ShardedParam], grads: list[torch.Tensor], options: ReductionOptions, held: HeldSums,
                 *, mesh_info: MeshInfo, comm: CommContext, comms: GroupComms, device: torch.device,
                 call: Callable[[str, int, torch.dtype], D.CollectiveCall]) -> None:
    """Reduce-scatter ``grads`` (emptied here) and accumulate each owner's shard into its sharded gradient;
    under HSDP all-reduce over the replicas first, or add to ``held`` when ``options.all_reduce`` is off.
    ``call`` names a collective for error messages and debug fingerprints."""
    world = mesh_info.shard_size
    reduce_dtype = owners[0].reduce_dtype or grads[0].dtype
    numels = [p.padded_numel for p in owners]
    total = sum(numels)
    pre, post = C.divide_factors(mesh_info.data_parallel_size, reduce_dtype, options.divide_factor,
                                 comms.force_sum)
    comm.wait_for_reduces(keep=comms.max_input_buffers - 1)  # older groups' reduction buffers may go now
    # Copy-in on the current stream, where autograd made the gradients, so
    # they can be freed right after it: the caller's list holds the only
    # references.  (At the root's reduction this is the step's peak.)
    rs_in = comms.reduce_scatter.allocate((world * total,), dtype=reduce_dtype, device=device)
    C.reduce_scatter_copy_in(grads, [p.shard_dim for p in owners], numels, world, rs_in)
    grads.clear()
    with comm.on("reduce_scatter"):
        if pre != 1.0:
            rs_in.div_(pre)
        if world > 1:
            rs_out = comms.reduce_scatter.allocate((total,), dtype=reduce_dtype, device=device)
            rs_group = comms.reduce_group(mesh_info.shard_group)
            with D.collective(call("reduce-scatter", rs_in.numel(), reduce_dtype), rs_group, device):
                comms.issue_reduce_scatter(rs_out, rs_in, rs_group)
        else:  # one shard rank: the laid-out input is already this rank's result
            rs_out = comms.single_rank_output(rs_in)
        if mesh_info.is_hsdp:
            if not options.all_reduce:
                _hold(owners, numels, rs_out, held, copy=comms.custom_reduce_scatter)
                comm.hold_until_done(comm.record("reduce_scatter"), rs_in)
                return
            for p, part in zip(owners, rs_out.split(numels)):
                earlier = held.pop(p, None)
                if earlier is not None:
                    part += earlier
            with D.collective(call("all-reduce", rs_out.numel(), reduce_dtype), mesh_info.replicate_group, device):
                C.all_reduce(rs_out, mesh_info.replicate_group)
        comms.finish_reduction(rs_out, post, reduce_dtype, device, comm.inline)
        offset = 0
        for p, numel in zip(owners, numels):
            p.accumulate_sharded_grad(rs_out.narrow(0, offset, p.sharded_size.numel()).view(p.sharded_size))
            offset += numel
    comm.hold_until_done(comm.record("reduce_scatter"), rs_in)


def _hold(owners: list[ShardedParam], numels: list[int], rs_out: torch.Tensor, held: HeldSums, *, copy: bool) -> None:
    """Sum the reduce-scattered gradients to all-reduce later, per parameter: which parameters have
    gradients can change between micro-batches (a grouped call used in part, a module left out of one).  A
    sum starts as a copy where a user's comm owns the buffer (``copy``), which it may reuse."""
    for p, part in zip(owners, rs_out.split(numels)):
        earlier = held.get(p)
        if earlier is None:
            held[p] = part.clone() if copy else part
        else:
            earlier += part
