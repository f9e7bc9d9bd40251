"""What a sharded module gains: the ``FSDPModule`` methods, ``UnshardHandle``
and ``register_fsdp_forward_method``.

``fully_shard`` swaps a module's class to ``FSDP<Name>(FSDPModule, Name)``, so
the module keeps its identity and stays an instance of its own class; every
method here acts on the sharding state ``fully_shard`` attached to it (its
groups, and with ``recurse`` those of its sharded submodules).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Literal

import torch
import torch.nn as nn

from shardkit.errors import ConfigurationError, DeepcopyUnsupportedError, TrainingStateError
from shardkit.runtime import comm_hooks as H
from shardkit.runtime.mesh_info import normalize_reshard_after_forward, post_forward_group
from shardkit.runtime.module_state import ShardState, state_of
from shardkit.runtime.param_group import ParamGroup

__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx", "swap_class",
           "states_of", "apply_reshard_after_forward"]


def apply_reshard_after_forward(group: ParamGroup, value: bool | int) -> None:
    """Set a group's post-forward policy from a normalized ``True``/``False``/int k."""
    if isinstance(value, bool):
        group.reshard_after_forward, group.post_forward_mesh = value, None
    else:
        group.reshard_after_forward = True
        group.post_forward_mesh = post_forward_group(group.mesh_info, value)


_fsdp_classes: dict[tuple[type, type], type] = {}


def swap_class(module: nn.Module, base: type | None = None) -> None:
    """Make ``module`` an instance of ``<Prefix><Name>(base, Name)``; ``base`` is
    :class:`FSDPModule` (prefix ``FSDP``) or a subclass named ``<Prefix>Module``."""
    base = base or FSDPModule
    cls = type(module)
    fsdp_cls = _fsdp_classes.get((cls, base))
    if fsdp_cls is None:
        prefix = "FSDP" if base is FSDPModule else base.__name__.removesuffix("Module")
        fsdp_cls = type(f"{prefix}{cls.__name__}", (base, cls), {"__deepcopy__": _no_deepcopy,
                                                                 "__module__": cls.__module__})
        _fsdp_classes[cls, base] = fsdp_cls
    module.__class__ = fsdp_cls


def _no_deepcopy(self: Any, memo: Any) -> Any:
    raise DeepcopyUnsupportedError(
        "FSDP does not support deepcopy. Please use state dict for serialization. A sharded "
        "module's parameters alias communication buffers: copy the model before fully_shard, "
        "or rebuild it and load a state dict"
    )


class UnshardHandle:
    """Returned by :meth:`FSDPModule.unshard`; ``wait()`` makes the unsharded
    parameters usable (a no-op once done, and for a synchronous unshard)."""

    def __init__(self, groups: list[ParamGroup] | None) -> None:
        self._groups = groups

    def wait(self) -> None:
        if self._groups:
            for group in self._groups:
                group.wait_for_unshard()
        self._groups = None


def states_of(root: nn.Module, recurse: bool) -> list[ShardState]:
    modules = root.modules() if recurse else [root]
    out, seen = [], set()
    for m in modules:
        state = state_of(m)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            out.append(state)
    return out


class FSDPModule:
    """Methods every sharded module gains (``type(m)`` is ``FSDP<Name>``)."""

    # where the module's own class sits in ``type(m).__mro__`` (a subclass adds one)
    _orig_cls_mro_index = 2

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers (e.g. nn.Sequential slicing) build new instances of
        # ``type(self)``; those are not sharded, so build the original class.
        orig = cls.__mro__[cls._orig_cls_mro_index]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def _shard_state(self) -> ShardState:
        state = state_of(self)  # type: ignore[arg-type]
        if state is None:  # pragma: no cover - class swapped by hand
            raise TrainingStateError(f"{type(self).__name__} has no sharding state")
        return state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (not its sharded submodules').

        With ``async_op=True`` the returned handle's ``wait()`` (or the
        module's own forward) completes it, so it can overlap other work;
        with ``False`` it is done on return, and returns None (as torch's)."""
        groups = self._shard_state().groups
        for group in groups:
            group.unshard(async_op=async_op)
        handle = UnshardHandle(list(groups))
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded DTensors (not recursive)."""
        for group in self._shard_state().groups:
            group.reshard()

    def reset_iter_state(self) -> None:
        """After an exception mid forward/backward, call on the root to start clean
        (the failed iteration's gradient reductions are dropped)."""
        self._shard_state().reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward ends the step (finalizes; clears prefetch order)."""
        self._shard_state().ctx.is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False`` accumulates unsharded gradients locally without communication
        (FSDP1's ``no_sync``); the next backward with ``True`` reduces the sum.
        For HSDP this covers both the reduce-scatter and the all-reduce."""
        for state in states_of(self, recurse):  # type: ignore[arg-type]
            for group in state.groups:
                group.reduce_grads = requires_gradient_sync
                group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only: ``False`` reduce-scatters but defers the replicate all-reduce."""
        for state in states_of(self, recurse):  # type: ignore[arg-type]
            for group in state.groups:
                group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, recurse: bool = True) -> None:
        """Change the post-forward policy (``True``/``False``/int k) of this module (and below)."""
        for state in states_of(self, recurse):  # type: ignore[arg-type]
            state.auto_reshard_after_forward = False
            for group in state.groups:
                value = normalize_reshard_after_forward(reshard_after_forward, group.mesh_info.shard_size)
                apply_reshard_after_forward(group, value)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps parameters unsharded after backward (saves the next
        forward's all-gather during gradient accumulation, costs memory)."""
        for state in states_of(self, recurse):  # type: ignore[arg-type]
            for group in state.groups:
                group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather ``modules`` right after this module's own all-gather in forward."""
        self._shard_state().forward_prefetch = [_require_fsdp(m)._shard_state() for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather ``modules`` at this module's pre-backward.  Any list, even
        an empty one, replaces the default (the module that ran forward just
        before this one): ``[]`` turns backward prefetching off for this module."""
        self._shard_state().backward_prefetch = [_require_fsdp(m)._shard_state() for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the
        data-parallel size (not its sharded submodules', as in torch)."""
        if factor <= 0:
            raise ConfigurationError(f"gradient divide factor must be positive, got {factor}")
        for group in self._shard_state().groups:
            group.gradient_divide_factor = float(factor)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Reduce zeros for trainable params that got no gradient, so ranks that
        used a parameter and ranks that did not still run the same collective."""
        for state in states_of(self, recurse):  # type: ignore[arg-type]
            for group in state.groups:
                group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False`` for modules whose parameters backward never reads (skips an all-gather)."""
        for group in self._shard_state().groups:
            group.unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event: torch.Event) -> None:
        """On an accelerator, make the next forward's all-gathers wait on this
        event (recorded after ``optimizer.step()``).  Accepted for
        compatibility: shardkit's all-gather stream already waits on the
        current stream before each all-gather, which orders it after the step."""
        self._shard_state().ctx.post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated: use :meth:`set_gradient_divide_factor` (warns as torch does)."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with ``SUM`` only and divide outside the collectives, at
        torch's force-sum positions: a custom divide factor is then applied
        after the reduction (split for fp16), and the all-reduce hook sees the
        undivided sum.  shardkit's collectives always sum; this moves the divisions."""
        for group in self._shard_state().groups:
            group.comms.force_sum = enable

    def set_custom_all_gather(self, comm: Any) -> None:
        """Replace this group's all-gather with ``comm`` (torch's ``AllGather``
        protocol: ``allocate(size, *, dtype, device)`` for the output buffer,
        ``comm(output_tensor=, input_tensor=, group=, async_op=)`` to issue it).
        Works on any backend the comm itself supports, gloo included."""
        H.check_comm(comm, "set_custom_all_gather")
        for group in H.only_group(self._shard_state().groups, "set_custom_all_gather", "custom comm"):
            group.comms.all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Replace this group's reduce-scatter with ``comm`` (torch's
        ``ReduceScatter`` protocol; it is given ``op=ReduceOp.SUM`` and shardkit
        divides, see comm_hooks Note [the reduce op a custom reduce-scatter is given])."""
        H.check_comm(comm, "set_custom_reduce_scatter")
        for group in H.only_group(self._shard_state().groups, "set_custom_reduce_scatter", "custom comm"):
            group.comms.reduce_scatter = comm

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(reduce_output)`` in place on each reduced gradient: the
        reduce-scatter output on a 1-D mesh (e.g. a user's own replicate
        all-reduce), after the all-reduce with native HSDP.  ``stream`` (not
        with native HSDP) runs it on that stream; on the CPU it runs inline."""
        for group in H.only_group(self._shard_state().groups, "set_all_reduce_hook", "hook"):
            group.comms.all_reduce_hook = hook
            if stream is not None:
                if group.mesh_info.is_hsdp:
                    raise ConfigurationError("stream cannot be set when using native HSDP; the hook runs after "
                                             "the HSDP all-reduce, on its stream")
                group.comms.hook_stream = stream
                if group.comm.inline:
                    H.warn_no_effect("set_all_reduce_hook(stream=...)")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many groups' reduce-scatter input buffers may be in flight at
        once on an accelerator (default 1): more overlap, more peak memory.
        CPU collectives complete inline, so none is ever in flight there."""
        value = H.check_max_input_buffers(max_input_buffers)
        for state in states_of(self, recurse):  # type: ignore[arg-type]
            for group in state.groups:
                group.comms.max_input_buffers = value
                if group.comm.inline:
                    H.warn_no_effect("set_reduce_scatter_max_input_buffers")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Reduce-scatter on a process group of its own over the shard ranks, so
        it can overlap the all-gather; ``False`` goes back to the shared group.
        Collective: call it on every rank of the mesh."""
        H.separate_reduce_scatter_groups([g for s in states_of(self, recurse) for g in s.groups],  # type: ignore
                                         enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Stage collective buffers in the process group's own allocator where
        its backend has one (NCCL); gloo has none, so buffers stay ordinary
        memory.  Not together with a custom all-gather/reduce-scatter."""
        for group in self._shard_state().groups:
            H.use_process_group_memory(group.comms, enable, group.mesh_info.shard_group, group.device)

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Symmetric-memory staging buffers (NCCL on CUDA): not implemented by
        shardkit; raises ``UnsupportedBackendError`` (a ``RuntimeError``, as torch
        raises on gloo) instead of running without it."""
        for group in self._shard_state().groups:
            H.refuse_symm_mem(group.comms, backend, group.mesh_info.shard_group)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """All-gather with ``async_op`` in pre-forward/pre-backward, for this
        module and every sharded module below it."""
        for state in states_of(self, True):  # type: ignore[arg-type]
            for group in state.groups:
                group.unshard_async_op = async_op

    def _get_fsdp_state(self) -> ShardState:
        """torch's accessor: the sharding state of this module (``fully_shard.state(m)``)."""
        return self._shard_state()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``module.to(...)``/``to_empty``: act on the sharded DTensors, then re-pad
        # their local tensors and re-derive dtypes at the next use.
        state = self._shard_state()
        for group in state.groups:
            group.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        with torch.no_grad():
            for group in state.groups:
                for p in group.params:
                    p.reset_sharded_param()
                group.invalidate()
        return result


def _require_fsdp(module: Any) -> FSDPModule:
    if not isinstance(module, FSDPModule):
        raise ConfigurationError(f"expected a module sharded with fully_shard, got {type(module).__name__}")
    return module


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run the same hooks as ``module(...)``
    (e.g. ``generate``).  A no-op for modules that are not sharded."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ConfigurationError(f"{type(module).__name__} has no method {method_name!r}")
    original = getattr(module, method_name)
    state = module._shard_state()

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.module_pre_forward(module, args, kwargs)  # type: ignore[arg-type]
        out = original(*args, **kwargs)
        return state.module_post_forward(module, args, out)  # type: ignore[arg-type]

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots (pipeline-parallel model chunks) share one
    communication context: the streams, the in-flight reductions and the
    prefetch order, instead of one each."""
    if not modules:
        return
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ConfigurationError(f"Expects list of FSDPModules but got {module}")
    states = [m._shard_state() for m in modules]
    shared = states[0].comm
    for state in states[1:]:
        for member in state.ctx.all_states or [state]:  # a root already initialized hands it down
            member.comm = shared
            for group in member.groups:
                group.comm = shared
