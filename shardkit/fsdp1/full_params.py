"""FSDP1's ``summon_full_params``: full parameters on the modules, for a while.

Inside the context every sharded parameter of the chosen units is replaced
on its module(s) by an ordinary ``nn.Parameter`` holding the full tensor in
the sharded parameter's own dtype (full precision, as FSDP1 promises even
under mixed precision), gathered with ``DTensor.full_tensor()``.  On exit
the sharded ``DTensor`` parameters are registered again; with
``writeback=True`` each rank first copies its slice of the (possibly edited)
full tensor into its shard, which is all the next all-gather reads.

This works on the sharded parameters alone, so it does not depend on the
core's unshard buffers.  Units that still hold unsharded parameters (e.g.
``SHARD_GRAD_OP`` after a forward) are resharded first; inside backward it
refuses to run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardkit.errors import ConfigurationError, TrainingStateError
from shardkit.runtime import FSDPModule, sharded_params_of

__all__ = ["summon_full_params", "managed_params"]


def _is_unit(m: nn.Module) -> bool:
    return isinstance(m, FSDPModule)


def _top_units(module: nn.Module) -> list[nn.Module]:
    """Units in ``module``'s tree not nested inside another unit of that tree."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if _is_unit(m):
            out.append(m)
            return
        for child in m.children():
            visit(child)

    visit(module)
    return out


def managed_params(unit: nn.Module) -> list[tuple[list[tuple[nn.Module, str]], DTensor]]:
    """For each parameter the unit's own group shards: every (module, name) it
    is registered under (tied weights have several) and the sharded ``DTensor``."""
    return [([(sp.info.module, sp.info.name), *sp.info.shared], sp.sharded_param)
            for sp in sharded_params_of(unit, recurse=False)]


@dataclass
class _Summoned:
    owners: list[tuple[nn.Module, str]]
    sharded: DTensor
    full: nn.Parameter | None  # None: this rank keeps the shard (rank0_only)


def _check_at_rest(units: list[nn.Module]) -> None:
    if torch._C._current_graph_task_id() != -1:
        raise TrainingStateError("summon_full_params cannot run inside backward; call it before the "
                                 "forward or after backward and optimizer step")
    for unit in units:
        if any(owner._parameters.get(name) is not sharded
               for owners, sharded in managed_params(unit) for owner, name in owners):
            unit.reshard()  # e.g. SHARD_GRAD_OP kept them after a forward with no backward yet


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False) -> Generator[None, None, None]:
    """Expose full parameters of the units in ``module`` (all nested units with
    ``recurse``, else the outermost ones only).  A collective: every rank enters."""
    if rank0_only and writeback:
        raise ConfigurationError("summon_full_params(rank0_only=True, writeback=True) is not supported: "
                                 "other ranks hold no full parameters to write back; pass writeback=False")
    units = [m for m in module.modules() if _is_unit(m)] if recurse else _top_units(module)
    _check_at_rest(units)
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    summoned: dict[int, _Summoned] = {}
    for unit in units:
        for owners, sharded in managed_params(unit):
            entry = summoned.get(id(sharded))
            if entry is None:
                entry = summoned[id(sharded)] = _gather(sharded, keep, offload_to_cpu, with_grads)
            entry.owners.extend(owners)
    for entry in summoned.values():
        if entry.full is not None:
            for owner, name in entry.owners:
                owner._parameters[name] = entry.full
    try:
        yield
    finally:
        with torch.no_grad():
            for entry in summoned.values():
                for owner, name in entry.owners:
                    owner._parameters[name] = entry.sharded
                if writeback and entry.full is not None:
                    _write_back(entry.sharded, entry.full)


def _gather(sharded: DTensor, keep: bool, offload_to_cpu: bool, with_grads: bool) -> _Summoned:
    with torch.no_grad():
        full = sharded.full_tensor()
        grad = sharded.grad.full_tensor() if with_grads and isinstance(sharded.grad, DTensor) else None
    if not keep:
        return _Summoned([], sharded, None)
    if offload_to_cpu:
        full, grad = full.cpu(), (grad.cpu() if grad is not None else None)
    param = nn.Parameter(full, requires_grad=sharded.requires_grad)
    if grad is not None:
        param.grad = grad
    return _Summoned([], sharded, param)


def _write_back(sharded: DTensor, full: torch.Tensor) -> None:
    local = sharded.to_local()
    piece = distribute_tensor(full.detach().to(local.device), sharded.device_mesh, sharded.placements,
                              src_data_rank=None).to_local()
    local.copy_(piece)
