"""FSDP1's ``clip_grad_norm_`` over sharded, replicated and ignored gradients.

Why not ``torch.nn.utils.clip_grad_norm_``: it works for a model whose
gradients are all ``DTensor``s on one mesh (a plain ``fully_shard`` model),
but an FSDP1 model can mix

* ``DTensor`` gradients on several meshes (a ``CustomPolicy`` can give units
  different strategies), whose norms must be reduced over each mesh's shard
  dims only: on an HSDP or ``NO_SHARD`` mesh the replicate dim holds copies,
  and summing over it would count each gradient once per replica;
* plain-tensor gradients of ignored parameters, which every rank holds whole
  and which must be counted once, not once per rank.

So the total norm is the norm of all gradients viewed as one vector: each
``DTensor`` gradient contributes ``sum |g|^p`` of its local shard, summed
(``max`` for the inf-norm) over the ranks that hold *different* pieces (its
mesh's shard dims), and plain gradients are added locally.

Device work stays on the device: per-tensor norms come from one
``torch._foreach_norm`` per device (no host round trip per parameter), the
sums are all-reduced on the device (one all-reduce per distinct set of shard
groups, not per parameter), and the clip coefficient is applied with one
``torch._foreach_mul_`` per device and dtype.  The host never waits for the
device per parameter; it waits at most once per set of shard groups, and
only when gradients live on the CPU (offloaded) while their mesh reduces on
the accelerator.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from shardkit.runtime.mesh_info import device_from_mesh

__all__ = ["clip_grad_norm_"]


def _shard_groups(grad: DTensor) -> tuple[dist.ProcessGroup, ...]:
    mesh = grad.device_mesh
    return tuple(mesh.get_group(dim) for dim, placement in enumerate(grad.placements)
                 if isinstance(placement, Shard) and mesh.size(dim) > 1)


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


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients in place so that their total ``norm_type``-norm is at most
    ``max_norm``; return the total norm (before clipping) on the gradients'
    device, in their promoted dtype.  A collective: call it on every rank."""
    norm_type = float(norm_type)
    is_inf = math.isinf(norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = locals_[0].device if locals_ else torch.device("cpu")
    dtypes = sorted({g.dtype for g in grads}, key=str)
    acc = functools.reduce(torch.promote_types, dtypes, torch.float32)  # at least float32, never narrowing
    # (shard groups, the device their backend reduces on) -> local gradients
    by_groups: dict[tuple[tuple[dist.ProcessGroup, ...], torch.device], list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for g, local in zip(grads, locals_):
        if isinstance(g, DTensor):
            by_groups.setdefault((_shard_groups(g), device_from_mesh(g.device_mesh)), []).append(local)
        else:
            plain.append(local)
    total = _local_power_sum(plain, norm_type, device, acc)
    for (groups, comm_device), tensors in by_groups.items():
        part = _local_power_sum(tensors, norm_type, comm_device, acc)  # offloaded grads: reduce on the mesh's device
        for group in groups:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=group)
        part = part.to(device)
        total = torch.maximum(total, part) if is_inf else total + part
    total_norm = total if is_inf else total.pow(1.0 / norm_type)
    clip_coef = (float(max_norm) / (total_norm + 1e-6)).clamp(max=1.0)
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for local in locals_:
        by_device_dtype.setdefault((local.device, local.dtype), []).append(local)
    for (dev, dtype), tensors in by_device_dtype.items():
        torch._foreach_mul_(tensors, clip_coef.to(device=dev, dtype=dtype))
    return total_norm.to(device=device, dtype=functools.reduce(torch.promote_types, dtypes or [torch.float32]))
