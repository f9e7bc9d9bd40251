"""The hooks of one ``fully_shard`` call, and what all calls under a root share.

Note [the root]
    ``fully_shard`` is applied bottom-up, so no call knows which module will
    be the root.  The first state to run forward is the root: at that moment
    (lazy init) it walks its module tree, marks every other state non-root,
    and hands them one :class:`IterationContext` and one ``CommContext``.
    Unless the user chose ``reshard_after_forward`` for it, the root keeps
    its parameters after forward, because backward needs them first.

Note [end of backward]
    The first pre-backward hook of a backward queues one callback on the
    autograd engine.  It runs when the whole backward is done and finishes
    every group that did not run its post-backward (its inputs needed no
    gradient, or it was not used), then resets all states to IDLE.

    It also reshards every group that reshards after backward, even one whose
    post-backward ran: the default backward prefetch follows the post-forward
    order, which only the last backward clears (``set_is_last_backward``), so
    in the next micro-batch the first group's prefetch reaches back to the
    previous forward's last group and unshards it after its own
    post-backward.  torch leaves that all-gather pending (the next forward
    uses it, the last backward drops it); an inline (CPU) prefetch here
    copies out at once, so without this the group's modules
    would keep their unsharded parameters after backward, and whatever reads
    the module's parameters (``clip_grad_norm_``, a gradient check) would
    miss the sharded gradients.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_map

from shardkit.errors import TrainingStateError
from shardkit.runtime.compile import eager_hook
from shardkit.runtime.device_sync import CommContext
from shardkit.runtime.param_group import ParamGroup, TrainingState
from shardkit.runtime.policies import MixedPrecisionPolicy
from shardkit.runtime.torch_names import TorchStateNames
from shardkit.wire.fqn import without_compile_parts

__all__ = ["IterationContext", "ShardState", "STATE_ATTR", "state_of"]

STATE_ATTR = "_shardkit_state"


def state_of(module: nn.Module) -> "ShardState | None":
    return module.__dict__.get(STATE_ATTR)


class IterationContext:
    """Per-iteration facts shared by every state under one root."""

    def __init__(self) -> None:
        self.all_states: list[ShardState] = []
        self.iter_forward_root: ShardState | None = None
        self.callback_queued = False
        self.is_last_backward = True
        self.post_optim_event: Any = None


class ShardState(TorchStateNames):
    """Hooks and root logic for the module(s) of one ``fully_shard`` call."""

    def __init__(self, modules: tuple[nn.Module, ...], device: torch.device, mp_policy: MixedPrecisionPolicy,
                 auto_reshard_after_forward: bool) -> None:
        self.modules = modules
        self.device = device
        self.mp_policy = mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.groups: list[ParamGroup] = []
        self.is_root: bool | None = None
        self.ctx = IterationContext()
        self.comm = CommContext(device)
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[ShardState] = []
        # None: the default (the state that ran forward just before this one);
        # a list, even an empty one, replaces it ([] prefetches nothing).
        self.backward_prefetch: list[ShardState] | None = None
        self._to_run: set[nn.Module] = set()  # modules of this call still to run in this forward
        self._warned_view = False
        self._handles = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self.module_pre_forward, prepend=True,
                                                                  with_kwargs=True))
            self._handles.append(module.register_forward_hook(self.module_post_forward, prepend=False))

    # ------------------------------------------------------------ lazy init

    def lazy_init(self) -> None:
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise TrainingStateError(
                f"FSDP requires a single root module but got {self.modules}. A fully_shard call over "
                "a list of modules cannot be the root; apply fully_shard to the module that contains "
                "them as well"
            )
        root = self.modules[0]
        states: list[ShardState] = []
        for name, module in root.named_modules():
            state = state_of(module)
            if state is None or any(state is s for s in states):
                continue
            if state is not self and state.is_root is not None:
                raise TrainingStateError(
                    f"FSDP state has already been lazily initialized for {name}\n"
                    "FSDP requires running forward through the root module first: the sharded "
                    f"module {name!r} already ran forward as a root; run the first forward "
                    "through the outermost sharded module"
                )
            states.append(state)
        # only now, with every state checked: a refused root leaves nothing half set
        self.is_root = True
        for state in states:
            if state is not self:
                state.is_root = False
            self.ctx.all_states.append(state)
        if self.auto_reshard_after_forward:
            for group in self.groups:
                group.reshard_after_forward = False
                group.post_forward_mesh = None
        for state in self.ctx.all_states:
            state.ctx, state.comm = self.ctx, self.comm
            for group in state.groups:
                group.comm = self.comm
        self._init_fqns(root)
        for state in self.ctx.all_states:
            for group in state.groups:
                group.lazy_init()

    def _init_fqns(self, root: nn.Module) -> None:
        """Names for messages: FQNs under the root, as the eager model spells them."""
        # by where each parameter is registered, not by the object: one the user replaced
        # since fully_shard is only taken up by the group's lazy init, after this
        by_slot = {(id(p.info.module), p.info.name): p for s in self.ctx.all_states for g in s.groups
                   for p in g.params}
        for prefix, module in root.named_modules():
            for name in module._parameters:
                sp = by_slot.get((id(module), name))
                if sp is not None:
                    sp.fqn = without_compile_parts(f"{prefix}.{name}" if prefix else name)
        for name, module in root.named_modules():
            state = state_of(module)
            if state is not None:
                for group in state.groups:
                    group.module_fqn = without_compile_parts(name)
                    group.fqn = group.module_fqn or "<root>"

    # -------------------------------------------------------------- forward

    @eager_hook
    def module_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The forward pre-hook on each module of this state; public because forward methods
        registered with ``register_fsdp_forward_method`` run inside it too."""
        if not self._to_run:
            self._to_run.update(self.modules)
        return self.pre_forward(module, args, kwargs)

    @eager_hook
    def module_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        """The forward hook matching :meth:`module_pre_forward` (and called around the same methods)."""
        if self.training_state is TrainingState.IDLE:
            # already finished for this call (a registered forward method ran inside __call__)
            return output
        self._to_run.discard(module)
        if self._to_run:  # a grouped call whose other modules have not run yet
            return self._cast_output(output)
        return self.post_forward(module, args, output)

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.training_state is TrainingState.PRE_BACKWARD:
            # activation-checkpoint recompute inside backward: just make sure params are there
            for group in self.groups:
                if not group.is_unsharded:
                    group.unshard()
                    group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        first_in_pass = self.training_state is not TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        if first_in_pass:
            args, kwargs = self._root_pre_forward(args, kwargs)
        args, kwargs = self._cast_inputs(args, kwargs)
        for group in self.groups:
            args, kwargs = group.pre_forward(args, kwargs)
        if first_in_pass:
            for state in self.forward_prefetch:
                for group in state.groups:
                    group.prefetch(TrainingState.FORWARD)
        return args, kwargs

    def _root_pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.lazy_init()
        ctx = self.ctx
        if ctx.iter_forward_root is not None:
            return args, kwargs
        ctx.iter_forward_root = self
        comm = self.comm
        if not comm.inline:
            event, ctx.post_optim_event = ctx.post_optim_event, None
            comm.stream_waits("all_gather", event)
            device = self.device
            args, kwargs = tree_map(lambda t: t.to(device, non_blocking=True)
                                    if isinstance(t, torch.Tensor) else t, (args, kwargs))
        return args, kwargs

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return self._cast_output(output)
        for group in self.groups:
            group.post_forward()
        output = self._register_pre_backward(output)
        self.training_state = TrainingState.IDLE
        if self.ctx.iter_forward_root is self:
            output = self._complete_partial_states(output)
            self.ctx.iter_forward_root = None
        return self._cast_output(output)

    def _complete_partial_states(self, output: Any) -> Any:
        """Finish grouped calls of which only some modules ran (e.g. a chunked loss head)."""
        for state in reversed(self.ctx.all_states):
            if state is self or not state._to_run:
                continue
            for group in state.groups:
                group.post_forward()
            output = state._register_pre_backward(output)
            state.training_state = TrainingState.IDLE
            state._to_run.clear()
        return output

    def _register_pre_backward(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output

        def hook(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                if t._base is not None and not self._warned_view:
                    self._warned_view = True
                    warnings.warn(
                        f"a sharded {type(self.modules[0]).__name__} returned a view; an in-place op on "
                        "it would drop the hook that all-gathers the parameters for backward. Use "
                        "out-of-place ops on module outputs (out = out + y) or .clone() them",
                        stacklevel=4,
                    )
                t.register_hook(self._pre_backward)
            return t

        tree_map(hook, output)
        return output

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtype = self.mp_policy.param_dtype
        if dtype is None or not self.mp_policy.cast_forward_inputs:
            return args, kwargs
        return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                        (args, kwargs))

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return output
        return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                        output)

    # ------------------------------------------------------------- backward

    @eager_hook
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            Variable._execution_engine.queue_callback(self._root_final_callback)
        explicit = self.backward_prefetch is not None
        for group in self.groups:
            group.pre_backward(default_prefetch=not explicit)
        for state in self.backward_prefetch or ():
            for group in reversed(state.groups):
                group.prefetch(TrainingState.PRE_BACKWARD)
        return grad

    def _root_final_callback(self) -> None:
        ctx = self.ctx
        ctx.iter_forward_root = None
        for state in ctx.all_states:
            state._to_run.clear()
            for group in reversed(state.groups):
                if group.training_state is not TrainingState.POST_BACKWARD:
                    group.post_backward()
                elif group.reshard_after_backward:
                    group.reshard()  # undo a default prefetch that came after its post-backward
                group.training_state = TrainingState.IDLE
                if ctx.is_last_backward:
                    group.finalize_backward()
            state.training_state = TrainingState.IDLE
        if ctx.is_last_backward:
            self.comm.post_forward_order.clear()
            self.comm.wait_for_reduces()
        ctx.callback_queued = False

    def reset_iter_state(self) -> None:
        if self.is_root is False:
            raise TrainingStateError("reset_iter_state must be called on the root sharded module")
        states = self.ctx.all_states or [self]
        for state in states:
            state._to_run.clear()
            state.training_state = TrainingState.IDLE
            for group in state.groups:
                group.reset_iter_state()
        self.comm.post_forward_order.clear()
        self.comm.wait_for_reduces()
        self.ctx.iter_forward_root = None
        self.ctx.callback_queued = False
