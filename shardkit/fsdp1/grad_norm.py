"""FSDP1's ``clip_grad_norm_`` over sharded, replicated and ignored gradients.

The total norm is the norm of all gradients viewed as one vector.  Each
``DTensor`` gradient contributes ``sum |g|^p`` of its local shard, summed
(``max`` for the inf-norm) over the ranks that hold *different* pieces: the
shard dims of its mesh, never the replicate dim, whose ranks hold copies.
Plain-tensor gradients (ignored parameters) are local to every rank and are
added once, as FSDP1 does.  One all-reduce per distinct shard group, not per
parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

__all__ = ["clip_grad_norm_"]


def _shard_groups(grad: DTensor) -> tuple[dist.ProcessGroup, ...]:
    mesh = grad.device_mesh
    return tuple(mesh.get_group(dim) for dim, placement in enumerate(grad.placements)
                 if isinstance(placement, Shard) and mesh.size(dim) > 1)


def _local_power_sum(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack([torch.linalg.vector_norm(t.detach(), norm_type, dtype=torch.float32).cpu()
                         for t in tensors])
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum()


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients in place so that their total ``norm_type``-norm is at most
    ``max_norm``; return the total norm (before clipping).  A collective: call
    it on every rank."""
    norm_type = float(norm_type)
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    by_groups: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = {}
    local_only: list[torch.Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            by_groups.setdefault(_shard_groups(g), []).append(g.to_local())
        else:
            local_only.append(g)
    is_inf = math.isinf(norm_type)
    total = _local_power_sum(local_only, norm_type)
    for groups, local in by_groups.items():
        part = _local_power_sum(local, norm_type)
        device = local[0].device if local else torch.device("cpu")
        part = part.to(device)
        for group in groups:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=group)
        part = part.cpu()
        total = torch.maximum(total, part) if is_inf else total + part
    total_norm = total if is_inf else total.pow(1.0 / norm_type)
    out_dtype = torch.float32
    if grads:
        out_dtype = grads[0].dtype
        for g in grads[1:]:
            out_dtype = torch.promote_types(out_dtype, g.dtype)
    clip_coef = (float(max_norm) / (total_norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(clip_coef.to(device=local.device, dtype=local.dtype))
    device = grads[0].device if grads else torch.device("cpu")
    return total_norm.to(device=device, dtype=out_dtype)
