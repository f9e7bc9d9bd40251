"""``memory_report(model)``: what each FSDP group holds on this rank, now.

The questions behind an out-of-memory error in a sharded job are "which
groups are unsharded right now?" (one left unsharded by a skipped hook, or
``reshard_after_forward=False`` on every block, holds whole parameters) and
"how big is each group sharded, unsharded and in gradients?".  The report
answers both from the runtime's own bookkeeping, without communication, so
it can be called anywhere, including inside a forward hook or in an
exception handler.

Sizes are bytes on this rank.  ``sharded_bytes`` counts the padded shard
storage (what the all-gather sends), ``unsharded_bytes`` the full parameters
of the group in the compute dtype (TP-local for tensor-parallel parameters)
whether or not they are allocated now, and ``gradient_bytes`` the gradients
held now: the sharded ``.grad`` of each parameter plus any unsharded gradient
waiting for its reduce-scatter (or kept by ``set_requires_gradient_sync(False)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardkit.runtime.module_state import state_of
from shardkit.runtime.param_group import ParamGroup
from shardkit.runtime.sharded_param import ShardedParam, ShardedState
from shardkit.wire.fqn import without_compile_parts

__all__ = ["GroupMemory", "MemoryReport", "memory_report"]


@dataclass(frozen=True)
class GroupMemory:
    """One ``fully_shard`` group on this rank."""

    fqn: str                 # module FQN(s) relative to the model passed in ("" for the model itself)
    params: int              # parameters in the group
    sharded_bytes: int       # padded shards: what the group costs at rest
    unsharded_bytes: int     # full parameters in the compute dtype, allocated or not
    unsharded_allocated_bytes: int  # of those, allocated now (a 1/k slice counts after a post-forward reshard)
    gradient_bytes: int      # sharded .grad plus unsharded gradients not yet reduced
    state: str               # "sharded", "unsharded" or "sharded_post_forward"

    @property
    def is_unsharded(self) -> bool:
        return self.state == ShardedState.UNSHARDED.value


@dataclass(frozen=True)
class MemoryReport:
    """Per-group memory of one model on this rank; ``str()`` gives a table."""

    groups: list[GroupMemory] = field(default_factory=list)

    @property
    def unsharded(self) -> list[str]:
        """FQNs of the groups whose full parameters are registered right now."""
        return [g.fqn for g in self.groups if g.is_unsharded]

    @property
    def sharded_bytes(self) -> int:
        return sum(g.sharded_bytes for g in self.groups)

    @property
    def unsharded_allocated_bytes(self) -> int:
        return sum(g.unsharded_allocated_bytes for g in self.groups)

    @property
    def gradient_bytes(self) -> int:
        return sum(g.gradient_bytes for g in self.groups)

    def __str__(self) -> str:
        head = f"{'group':<32}{'sharded':>12}{'unsharded':>12}{'allocated':>12}{'grads':>12}  state"
        rows = [f"{(g.fqn or '<root>')[:31]:<32}{_mib(g.sharded_bytes):>12}{_mib(g.unsharded_bytes):>12}"
                f"{_mib(g.unsharded_allocated_bytes):>12}{_mib(g.gradient_bytes):>12}  {g.state}"
                for g in self.groups]
        total = (f"{'total':<32}{_mib(self.sharded_bytes):>12}{'':>12}{_mib(self.unsharded_allocated_bytes):>12}"
                 f"{_mib(self.gradient_bytes):>12}  unsharded now: "
                 f"{', '.join(fqn or '<root>' for fqn in self.unsharded) or 'none'}")
        return "\n".join([head, *rows, total])


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _nbytes(tensor) -> int:
    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return tensor.numel() * tensor.element_size()


def _param_memory(p: ShardedParam) -> tuple[int, int, int, int]:
    sharded = p.padded.numel() * p.padded.element_size()
    unsharded = p.mesh_info.shard_size * p.padded_numel * p.compute_dtype.itemsize
    allocated = p.buffer.untyped_storage().nbytes() if p.buffer is not None else 0
    allocated += _nbytes(p.post_forward_data)
    grads = _nbytes(p.sharded_param.grad) + _nbytes(p.accumulated_grad)
    if p.unsharded_param is not None:
        grads += _nbytes(p.unsharded_param.grad)
    return sharded, unsharded, allocated, grads


def _group_memory(fqn: str, group: ParamGroup) -> GroupMemory:
    totals = [sum(values) for values in zip(*(_param_memory(p) for p in group.params))] or [0, 0, 0, 0]
    return GroupMemory(fqn, len(group.params), *totals, state=group.sharded_state.value)


def memory_report(model: nn.Module) -> MemoryReport:
    """Per-group bytes (sharded, unsharded, gradients) and which groups are
    unsharded now, for every ``fully_shard`` group under ``model`` on this rank.
    Local: no communication."""
    names: dict[int, list[str]] = {}
    states = []
    for name, module in model.named_modules():
        state = state_of(module)
        if state is None:
            continue
        if id(state) not in names:
            states.append(state)
        names.setdefault(id(state), []).append(without_compile_parts(name))
    return MemoryReport([_group_memory(", ".join(names[id(state)]), group)
                         for state in states for group in state.groups])
