"""``clip_grad_norm_`` over gradients on any mix of meshes and placements.

Why not ``torch.nn.utils.clip_grad_norm_``: it stacks the per-parameter
norms as DTensors, which fails as soon as two gradients live on different
meshes, and that is the normal case of a 2-D model (tensor-parallel blocks
on the ``(dp, tp)`` mesh, embeddings and norms on the ``dp`` mesh alone), of
an FSDP1 model whose units use different strategies, or of ignored
parameters whose gradients are plain tensors.

The total norm is the norm of all gradients viewed as one vector.  Each
gradient contributes ``sum |g|^p`` of what this rank holds (``max |g|`` for
the inf-norm):

* a ``DTensor`` gradient is summed over the mesh dims on which it is
  ``Shard`` or ``_StridedShard`` (the ranks there hold different pieces) and
  never over ``Replicate`` dims (the ranks there hold copies; summing would
  count each piece once per replica).  A ``Partial`` gradient is first
  reduced to ``Replicate``: the norm of a sum is not the sum of norms;
* a plain tensor is one every rank holds whole (an ignored parameter, a
  replicated one), so it is counted locally, once.

Partial sums whose reductions share process groups are reduced together: one
all-reduce per distinct process group (per reduction device), not per
parameter or per mesh, on a small vector whose entry ``i`` is the partial sum
of the gradients reduced over the ``i``-th set of groups.  Every rank ends
with the same scalar.  Device work stays on the device: one
``torch._foreach_norm`` per device, one ``torch._foreach_mul_`` per device and
dtype for the clip, and no host synchronisation per parameter.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardkit.runtime.mesh_info import device_from_mesh

__all__ = ["clip_grad_norm_", "total_grad_norm"]

_GroupSet = tuple[dist.ProcessGroup, ...]


def _shard_groups(grad: DTensor) -> _GroupSet:
    """The process groups over which ``grad``'s pieces differ."""
    mesh = grad.device_mesh
    return tuple(mesh.get_group(dim) for dim, placement in enumerate(grad.placements)
                 if isinstance(placement, (Shard, _StridedShard)) and mesh.size(dim) > 1)


def _without_partial(grad: DTensor) -> DTensor:
    if not any(isinstance(p, Partial) for p in grad.placements):
        return grad
    return grad.redistribute(placements=[Replicate() if isinstance(p, Partial) else p for p in grad.placements])


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def _local_power_sum(tensors: list[torch.Tensor], norm_type: float, device: torch.device,
                     dtype: torch.dtype) -> torch.Tensor:
    """``sum |t|^p`` over all ``tensors`` (``max |t|`` for the inf-norm),
    accumulated in ``dtype`` on ``device``; no host synchronization."""
    parts = []
    for on_device in _by_device(tensors).values():
        norms = torch.stack(torch._foreach_norm(on_device, norm_type, dtype=dtype))
        parts.append((norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()).to(device))
    if not parts:
        return torch.zeros((), dtype=dtype, device=device)
    stacked = torch.stack(parts)
    return stacked.max() if math.isinf(norm_type) else stacked.sum()


def _reduce_partials(partials: torch.Tensor, group_sets: list[_GroupSet], is_inf: bool) -> None:
    """All-reduce entry ``i`` of ``partials`` over every group of ``group_sets[i]``,
    in place, with one collective per distinct group (in first-seen order, which
    is the same on every rank because the parameters are)."""
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    groups: dict[str, dist.ProcessGroup] = {}
    for group_set in group_sets:
        for group in group_set:
            groups.setdefault(group.group_name, group)
    for name, group in groups.items():
        rows = [i for i, group_set in enumerate(group_sets) if any(g.group_name == name for g in group_set)]
        if len(rows) == len(group_sets):
            dist.all_reduce(partials, op=op, group=group)
            continue
        index = torch.tensor(rows, device=partials.device)
        part = partials.index_select(0, index)
        dist.all_reduce(part, op=op, group=group)
        partials.index_copy_(0, index, part)


@torch.no_grad()
def total_grad_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all ``grads`` as one vector (see the module
    docstring), the same scalar on every rank, accumulated in at least float32.
    A collective: call it on every rank with the same parameters."""
    norm_type = float(norm_type)
    is_inf = math.isinf(norm_type)
    grads = [_without_partial(g) if isinstance(g, DTensor) else g for g in grads]
    locals_ = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    device = locals_[0].device if locals_ else torch.device("cpu")
    acc = functools.reduce(torch.promote_types, sorted({g.dtype for g in grads}, key=str), torch.float32)
    # (shard groups, the device their backend reduces on) -> local gradients
    by_groups: dict[tuple[_GroupSet, torch.device], list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for g, local in zip(grads, locals_):
        if isinstance(g, DTensor) and _shard_groups(g):
            by_groups.setdefault((_shard_groups(g), device_from_mesh(g.device_mesh)), []).append(local)
        else:
            plain.append(local)  # held whole (or replicated) by every rank: counted once
    total = _local_power_sum(plain, norm_type, device, acc)
    for comm_device in dict.fromkeys(d for _, d in by_groups):
        keys = [key for key in by_groups if key[1] == comm_device]
        # offloaded gradients: their partial sums are reduced on the mesh's device
        partials = torch.stack([_local_power_sum(by_groups[key], norm_type, comm_device, acc) for key in keys])
        _reduce_partials(partials, [groups for groups, _ in keys], is_inf)
        part = (partials.max() if is_inf else partials.sum()).to(device)
        total = torch.maximum(total, part) if is_inf else total + part
    return total if is_inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients in place so that their total ``norm_type``-norm is at most
    ``max_norm``; return the total norm (before clipping) as a plain tensor on
    the gradients' device, in their promoted dtype.

    Works for any mix of ``DTensor`` gradients (any meshes, ``Shard``,
    ``_StridedShard``, ``Replicate``, ``Partial``) and plain ones, e.g. a
    tensor-parallel model sharded by ``fully_shard`` (shardkit's or torch's),
    where ``torch.nn.utils.clip_grad_norm_`` fails.  A collective: call it on
    every rank with the same parameters."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = total_grad_norm(grads, norm_type)
    clip_coef = (float(max_norm) / (total_norm + 1e-6)).clamp(max=1.0)
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        local = g._local_tensor if isinstance(g, DTensor) else g
        by_device_dtype.setdefault((local.device, local.dtype), []).append(local)
    for (dev, dtype), tensors in by_device_dtype.items():
        torch._foreach_mul_(tensors, clip_coef.to(device=dev, dtype=dtype))
    out_dtype = functools.reduce(torch.promote_types, sorted({g.dtype for g in grads}, key=str) or [torch.float32])
    return total_norm.to(dtype=out_dtype)
