"""Who allocates and issues a group's collectives, and what runs on the reduced gradient.

torch 2.13 lets a user take over a group's communication: a ``Comm`` object
(``allocate(size, *, dtype, device)`` for the staging buffers and
``__call__(output_tensor, input_tensor, group, ...)`` for the collective)
replaces the all-gather or the reduce-scatter, a hook runs on each reduced
gradient, and settings choose where buffers come from and which process
group reduce-scatters.  A group always talks to a comm object, the defaults
here included, so a user's comm runs on exactly the path the default does.

Note [the reduce op a custom reduce-scatter is given]
    shardkit always reduce-scatters with ``ReduceOp.SUM`` and divides itself
    (gather_scatter, Note [SUM, then divide]): gloo has no ``PREMUL_SUM``.  A
    custom reduce-scatter is therefore called with ``op=ReduceOp.SUM`` where
    torch would pass ``AVG`` or ``PREMUL_SUM`` (torch passes ``SUM`` too once
    ``set_force_sum_reduction_for_comms(True)``); a comm that honours ``op``
    gives torch's gradients.

Note [where the all-reduce hook runs]
    torch calls the hook with the reduce-scatter output (1-D mesh) or the
    HSDP all-reduce output, before its post-division.  For fp32/bf16 without
    force-sum torch divides inside the collective (``AVG``/``PREMUL_SUM``),
    so the hook sees the divided gradient; with force-sum or fp16 it sees the
    sum (fp16: divided by the pre-factor only).  ``finish_reduction``
    reproduces both orders on shardkit's SUM-then-divide reduction.

Note [settings without effect here]
    Some settings only change something on an accelerator: process-group
    memory needs a backend with its own allocator (NCCL), a hook stream and
    in-flight reduce-scatter buffers need streams.  torch accepts them on gloo
    and the CPU, and so does shardkit (a drop-in takes nothing away), but not
    silently: the first such call in a process logs one WARNING per setting
    that says what happens instead (``warn_no_effect``).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from shardkit.errors import (
    ArgumentTypeError,
    ConfigurationError,
    ConflictingSettingError,
    UnsupportedBackendError,
)
from shardkit.runtime import gather_scatter as C

__all__ = ["DefaultAllGather", "DefaultReduceScatter", "ProcessGroupAllGather", "ProcessGroupReduceScatter",
           "GroupComms", "only_group", "check_comm", "use_process_group_memory", "refuse_symm_mem",
           "check_max_input_buffers", "separate_reduce_scatter_groups", "has_own_allocator", "warn_no_effect",
           "NO_EFFECT"]

log = logging.getLogger("shardkit.runtime.comm_hooks")

# Note [settings without effect here]: what happens instead, and why
NO_EFFECT = {
    "set_allocate_memory_from_process_group_for_comm": (
        "set_allocate_memory_from_process_group_for_comm(True) has no effect here: this process group's backend "
        "has no allocator of its own (that needs NCCL), so collective buffers come from the ordinary allocator, "
        "as with torch's fully_shard"),
    "set_all_reduce_hook(stream=...)": (
        "set_all_reduce_hook(stream=...) has no effect on the CPU: there are no streams, so the hook runs inline "
        "on the caller's thread right after each reduction, as with torch's fully_shard"),
    "set_reduce_scatter_max_input_buffers": (
        "set_reduce_scatter_max_input_buffers() has no effect on the CPU: reductions complete inline, so no "
        "reduce-scatter input buffer is ever held for a later one; it bounds memory on an accelerator"),
}


class DefaultAllGather:
    """torch's ``AllGather`` protocol over shardkit's flat all-gather."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        return C.issue_all_gather(output_tensor, input_tensor, group, async_op)


class DefaultReduceScatter:
    """torch's ``ReduceScatter`` protocol over shardkit's flat reduce-scatter."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any = dist.ReduceOp.SUM, async_op: bool = False) -> dist.Work | None:
        return C.reduce_scatter(output_tensor, input_tensor, group, op, async_op)


class _ProcessGroupMemory:
    """Staging buffers from the process group's own allocator where its
    backend has one (NCCL: zero-copy transfers), else ordinary memory (gloo)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if has_own_allocator(self.group, device):
            backend = self.group._get_backend(device)
            return backend.allocate_tensor(math.prod(int(s) for s in size), dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)


def has_own_allocator(group: dist.ProcessGroup, device: torch.device) -> bool:
    supports = getattr(group._get_backend(device), "supports_tensor_alloc", None)
    return supports is not None and bool(supports(device))


@functools.cache
def warn_no_effect(setting: str) -> None:
    """Log, once per process, that ``setting`` has no effect here and what
    happens instead (Note [settings without effect here])."""
    log.warning(NO_EFFECT[setting])


class ProcessGroupAllGather(_ProcessGroupMemory, DefaultAllGather):
    """The default all-gather, staging in process-group memory."""


class ProcessGroupReduceScatter(_ProcessGroupMemory, DefaultReduceScatter):
    """The default reduce-scatter, staging in process-group memory."""


_BUILT_IN = (DefaultAllGather, DefaultReduceScatter)


@dataclass
class GroupComms:
    """One group's communication settings (the ``FSDPModule.set_*`` comm methods)."""

    all_gather: Any = field(default_factory=DefaultAllGather)
    reduce_scatter: Any = field(default_factory=DefaultReduceScatter)
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    hook_stream: Any = None
    force_sum: bool = False
    max_input_buffers: int = 1
    reduce_scatter_group: dist.ProcessGroup | None = None  # None: the shard group

    @property
    def custom_reduce_scatter(self) -> bool:
        """Whether a user's comm allocates the reduce-scatter buffers: it may pool
        them and hand the same memory out again at the next reduction."""
        return type(self.reduce_scatter) not in (DefaultReduceScatter, ProcessGroupReduceScatter)

    def single_rank_output(self, inp: torch.Tensor) -> torch.Tensor:
        """The reduce-scatter output over one shard rank, where the laid-out input
        already is the result.  shardkit's own input is fresh memory that only this
        reduction holds, so it is the output.  A user's comm may reuse its input
        buffer at the next reduction, while the sharded gradient and a held HSDP
        sum still view this one; so, as torch does, the result goes into an output
        of the comm's allocating, or of ordinary memory if that is the input again."""
        if not self.custom_reduce_scatter:
            return inp
        out = self.reduce_scatter.allocate(tuple(inp.shape), dtype=inp.dtype, device=inp.device)
        if out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():
            out = torch.empty_like(inp)
        return out.copy_(inp)

    def reduce_group(self, shard_group: dist.ProcessGroup) -> dist.ProcessGroup:
        return self.reduce_scatter_group or shard_group

    def issue_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.reduce_scatter(output_tensor=out, input_tensor=inp, group=group, op=dist.ReduceOp.SUM)

    def finish_reduction(self, out: torch.Tensor, post: float, dtype: torch.dtype, device: torch.device,
                         inline: bool) -> None:
        """Run the all-reduce hook and the post-division in torch's order
        (Note [where the all-reduce hook runs])."""
        divided_in_collective = not self.force_sum and dtype in (torch.float32, torch.bfloat16)
        if post != 1.0 and (divided_in_collective or self.all_reduce_hook is None):
            out.div_(post)
            post = 1.0
        if self.all_reduce_hook is not None:
            if self.hook_stream is None or inline:
                self.all_reduce_hook(out)
            else:  # on the user's stream, ordered after the reduction and before what follows
                handle = getattr(torch, device.type)
                self.hook_stream.wait_stream(handle.current_stream())
                with handle.stream(self.hook_stream):
                    self.all_reduce_hook(out)
                handle.current_stream().wait_stream(self.hook_stream)
        if post != 1.0:
            out.div_(post)


def only_group(groups: list, method: str, what: str) -> list:
    """torch refuses a per-group comm setting when one call made several groups."""
    if len(groups) > 1:
        raise ConfigurationError(
            f"{method} is not supported with multiple param groups (from per-param mesh via "
            f"shard_placement_fn). The {what} would be ambiguous across groups with different meshes; "
            "call it on a module whose fully_shard call made one group"
        )
    return groups


def check_comm(comm: Any, method: str) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise ArgumentTypeError(
            f"{method} takes a comm object with allocate(size, *, dtype, device) and "
            f"__call__(output_tensor, input_tensor, group, ...), got {type(comm).__name__}"
        )


def _refuse_custom(comm: Any, method: str, kind: str, allowed: tuple[type, ...]) -> None:
    if type(comm) not in allowed:
        raise ConflictingSettingError(
            f"cannot call {method}() when {kind} comm is custom: {type(comm).__name__}; "
            "a custom comm allocates its own buffers, so set one or the other"
        )


def use_process_group_memory(comms: GroupComms, enable: bool, shard_group: dist.ProcessGroup,
                             device: torch.device) -> None:
    method = "set_allocate_memory_from_process_group"
    _refuse_custom(comms.all_gather, method, "all gather", (DefaultAllGather, ProcessGroupAllGather))
    comms.all_gather = ProcessGroupAllGather(shard_group) if enable else DefaultAllGather()
    _refuse_custom(comms.reduce_scatter, method, "reduce scatter", (DefaultReduceScatter, ProcessGroupReduceScatter))
    group = comms.reduce_group(shard_group)
    comms.reduce_scatter = ProcessGroupReduceScatter(group) if enable else DefaultReduceScatter()
    if enable and not (has_own_allocator(shard_group, device) and has_own_allocator(group, device)):
        warn_no_effect("set_allocate_memory_from_process_group_for_comm")


def refuse_symm_mem(comms: GroupComms, backend: str, shard_group: dist.ProcessGroup) -> None:
    """Symmetric-memory staging needs NCCL on CUDA, which shardkit does not
    drive yet: refuse it rather than run without it."""
    _refuse_custom(comms.all_gather, "set_symm_mem", "all gather", _BUILT_IN[:1])
    _refuse_custom(comms.reduce_scatter, "set_symm_mem", "reduce scatter", _BUILT_IN[1:])
    pg_backend = dist.get_backend(shard_group)
    if pg_backend != "nccl":
        raise UnsupportedBackendError(
            f"SymmetricMemory does not find allocation backend {backend}: set_symm_mem_for_comm needs NCCL "
            f"process groups on CUDA, and this module's shard group uses {pg_backend}; leave it unset there"
        )
    raise UnsupportedBackendError(
        f"set_symm_mem_for_comm({backend!r}): shardkit does not implement symmetric-memory staging buffers; "
        "leave it unset (collectives then use ordinary NCCL buffers), or use "
        "set_allocate_memory_from_process_group_for_comm(True) for NCCL's own allocator"
    )


def check_max_input_buffers(max_input_buffers: Any) -> int:
    # bool is an int subclass: True must not silently mean 1
    if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
        raise ArgumentTypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
    if max_input_buffers < 1:
        raise ConfigurationError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
    return max_input_buffers


def separate_reduce_scatter_groups(groups: list, enable: bool) -> None:
    """Give each group's reduce-scatter a process group of its own over the
    same ranks (one per rank set), or go back to the shard group.  Collective
    over each rank set, like every other comm setup."""
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for group in groups:
        if not enable:
            group.comms.reduce_scatter_group = None
            continue
        ranks = tuple(dist.get_process_group_ranks(group.mesh_info.shard_group))
        if ranks not in made:
            made[ranks] = group.comms.reduce_scatter_group or dist.new_group(list(ranks),
                                                                             use_local_synchronization=True)
        group.comms.reduce_scatter_group = made[ranks]
