"""One communication unit: the parameters of one ``fully_shard`` call.

A group all-gathers all its parameters in one collective and reduce-scatters
all its gradients in one collective.  Its life per iteration::

    IDLE --pre_forward--> FORWARD (unsharded) --post_forward--> IDLE (sharded,
    a 1/k slice, or still unsharded) --pre_backward--> PRE_BACKWARD (unsharded)
    --post_backward--> POST_BACKWARD (sharded, grads reduced) --final callback--> IDLE

Note [autograd and freed storage]
    Autograd saves the *unsharded* Parameter objects for backward.  Resharding
    frees their storage (``resize_(0)``) but keeps the objects, and
    unsharding refills the same storage, so the saved references see the
    right values again.  The refill is an in-place write, which bumps the
    version counter and makes autograd reject the saved tensors ("modified by
    an inplace operation"); the copy-out therefore runs under
    ``_unsafe_preserve_version_counter``.

Note [post-backward exactly once per use]
    ``_PostBackward`` wraps the forward *inputs* of the module.  Its backward
    runs after the module's backward, when every ``AccumulateGrad`` into the
    unsharded parameters has run (the engine orders ``AccumulateGrad`` first),
    so all gradients exist.  A module called twice gets two nodes and reduces
    twice; that is correct because the reduced shard is *added* to the
    existing sharded gradient.  Groups whose inputs need no gradient (an
    embedding over token ids) are finished by the root's end-of-backward
    callback instead.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardkit.errors import UnshardableParameterError
from shardkit.runtime import debug as D
from shardkit.runtime import gather_scatter as C
from shardkit.runtime.comm_hooks import GroupComms
from shardkit.runtime.device_sync import CommContext
from shardkit.runtime.grad_reduction import HeldSums, ReductionOptions, reduce_grads, take_unsharded_grads
from shardkit.runtime.mesh_info import MeshInfo, PostForwardGroup
from shardkit.runtime.policies import MixedPrecisionPolicy
from shardkit.runtime.sharded_param import ShardedParam, ShardedState, check_materialized
from shardkit.runtime.torch_names import TorchParamGroupNames

__all__ = ["TrainingState", "ParamGroup", "is_backward"]


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


def is_backward() -> bool:
    """True inside an autograd backward (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


# what a collective issued in each state is for, in error messages and debug fingerprints
_PHASES = {TrainingState.IDLE: "explicit unshard", TrainingState.FORWARD: "forward",
           TrainingState.PRE_BACKWARD: "backward", TrainingState.POST_BACKWARD: "backward"}


class _PendingAllGather:
    __slots__ = ("out", "work", "plan", "world", "event", "call", "group")

    def __init__(self, out, work, plan, world, event, call=None, group=None) -> None:
        self.out, self.work, self.plan, self.world, self.event = out, work, plan, world, event
        self.call, self.group = call, group


class ParamGroup(TorchParamGroupNames):
    """All-gather/reduce-scatter unit and its state machine (see module docstring)."""

    def __init__(self, params: list[ShardedParam], modules: tuple[nn.Module, ...], mesh_info: MeshInfo,
                 device: torch.device, mp_policy: MixedPrecisionPolicy, comm: CommContext) -> None:
        self.params = params
        self.modules = modules
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self.comm = comm  # its state's until lazy init, then the root's
        self.fqn = ", ".join(type(m).__name__ for m in modules)  # for messages; the FQN after lazy init
        self.module_fqn: str | None = None
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        # reshard_after_forward: True/False; post_forward_mesh is set for an int k
        self.reshard_after_forward = True
        self.post_forward_mesh: PostForwardGroup | None = None
        # user knobs (FSDPModule.set_*)
        self.reduce_grads = True
        self.all_reduce_grads = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None
        self.reduce_scatter_unused_params = False
        self.unshard_in_backward = True
        self.unshard_async_op = False
        self.comms = GroupComms()  # custom collectives, all-reduce hook, force-sum (comm_hooks)
        # per-iteration state
        self._pending: _PendingAllGather | None = None
        self._partial_reduce: HeldSums = {}  # HSDP: reduce-scattered, not all-reduced
        self._post_forward_indices: list[int] = []
        self._plans: dict[bool, C.AllGatherPlan] = {}
        self._initialized = False
        self._register_state_dict_hooks()

    # ------------------------------------------------------------ lazy init

    def lazy_init(self) -> None:
        """Derive dtypes and check the params are ready (after ``to_empty``, ``.to``)."""
        if self._initialized:
            return
        if self.sharded_state is ShardedState.SHARDED:
            # Users may replace a parameter between fully_shard and the first forward (e.g. set
            # a norm computed from other, now materialized, parameters): take what is registered,
            # once every replacement is known good, so a refused one leaves the group as it was.
            for p in self.params:
                p.check_replacement()
            for p in self.params:
                p.reset_sharded_param()
        check_materialized(self.params)
        for p in self.params:
            p.init_dtypes(self.mp_policy)
        trainable = {(p.reduce_dtype or p.compute_dtype) for p in self.params if p.requires_grad}
        if len(trainable) > 1:
            names = [(p.fqn, p.compute_dtype) for p in self.params if p.requires_grad]
            raise UnshardableParameterError(
                f"the trainable parameters of group [{self.fqn}] would reduce gradients in "
                f"different dtypes {sorted(map(str, trainable))}: {names}; one reduce-scatter needs one "
                "dtype, so give them a common dtype or shard them with separate fully_shard calls"
            )
        self._plans.clear()
        self._initialized = True

    def invalidate(self) -> None:
        """Re-derive dtypes at the next use (after ``module._apply``)."""
        self._initialized = False

    def _plan(self, post_forward: bool) -> C.AllGatherPlan:
        plan = self._plans.get(post_forward)
        if plan is None:
            world = self.mesh_info.shard_size
            numels = [p.padded_numel * world // self.post_forward_mesh.size if post_forward else p.padded_numel
                      for p in self.params]
            plan = self._plans[post_forward] = C.plan_all_gather(numels, [p.compute_dtype for p in self.params])
        return plan

    # -------------------------------------------------------------- unshard

    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    def unshard(self, async_op: bool = False) -> None:
        """Issue the group's all-gather (a no-op if unsharded or in flight)."""
        if self.sharded_state is ShardedState.UNSHARDED or self._pending is not None:
            return
        self.lazy_init()
        from_post_forward = self.sharded_state is ShardedState.SHARDED_POST_FORWARD
        if from_post_forward:
            pf = self.post_forward_mesh
            group, world, rank = pf.group, pf.size, pf.rank
        else:
            info = self.mesh_info
            group, world, rank = info.shard_group, info.shard_size, info.shard_rank
        if world == 1:
            self._pending = _PendingAllGather(None, None, None, 1, None)
            return
        plan = self._plan(from_post_forward)
        comm = self.comm
        call = self._call("all-gather", plan.per_rank, plan.dtype)
        with comm.on("all_gather"):
            inputs = [p.all_gather_input() for p in self.params]
            out = self.comms.all_gather.allocate((world * plan.per_rank,), dtype=plan.dtype, device=self.device)
            block = C.all_gather_copy_in(inputs, plan, out, rank)
            with D.collective(call, group, self.device):
                work = self.comms.all_gather(output_tensor=out, input_tensor=block, group=group, async_op=async_op)
            event = comm.record("all_gather")
        self._pending = _PendingAllGather(out, work, plan, world, event, call, group)

    def wait_for_unshard(self) -> None:
        """Finish a pending all-gather: copy out and register the unsharded params."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.work is not None:
            with D.naming_failures(pending.call, pending.group):
                pending.work.wait()
        self.comm.current_waits(pending.event)
        params = self.params
        buffers = tuple(p.alloc_unsharded() for p in params)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffers):
            if pending.world == 1:
                for p, buffer in zip(params, buffers):
                    buffer.copy_(p.all_gather_input())
            else:
                dests = [p.copy_out_view(pending.world) for p in params]
                shapes = [self._chunk_shape(p, pending.world) if p.shard_dim_copy else None for p in params]
                C.all_gather_copy_out(pending.out, pending.plan, pending.world, dests, shapes)
        for p in params:
            p.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    @staticmethod
    def _chunk_shape(p: ShardedParam, world: int) -> torch.Size:
        size = list(p.orig_size)
        size[p.shard_dim] //= world
        return torch.Size(size)

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones."""
        if self.sharded_state is not ShardedState.SHARDED:
            for p in self.params:
                p.to_sharded()
            self.sharded_state = ShardedState.SHARDED

    def _reshard_after_forward(self) -> None:
        if not self.reshard_after_forward or self.sharded_state is not ShardedState.UNSHARDED:
            return
        if self.post_forward_mesh is None:
            self.reshard()
            return
        for p in self.params:
            p.to_sharded_post_forward(self.post_forward_mesh.size, self.post_forward_mesh.rank)
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    # -------------------------------------------------------- forward hooks

    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        entering = self.training_state is not TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        self.unshard(self.unshard_async_op)
        self.wait_for_unshard()
        if entering and torch.is_grad_enabled() and not is_backward():
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def post_forward(self) -> None:
        if not is_backward():  # not during an activation-checkpoint recompute
            self._reshard_after_forward()
            if torch.is_grad_enabled():  # a backward may follow: remember the order for its prefetch
                self._post_forward_indices.append(len(self.comm.post_forward_order))
                self.comm.post_forward_order.append(self)
        self.training_state = TrainingState.IDLE

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves, spec = tree_flatten((args, kwargs))
        slots = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not slots:
            return args, kwargs
        outs = _PostBackward.apply(self, *(leaves[i] for i in slots))
        for i, t in zip(slots, outs):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    # ------------------------------------------------------- backward hooks

    def pre_backward(self, default_prefetch: bool) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard(self.unshard_async_op)
            self.wait_for_unshard()
        if default_prefetch and self._post_forward_indices:
            index = self._post_forward_indices.pop()
            if index > 0:
                self.comm.post_forward_order[index - 1].prefetch(TrainingState.PRE_BACKWARD)

    def prefetch(self, state: TrainingState) -> None:
        """Unshard ahead of use.  An inline (CPU) synchronous all-gather gains
        nothing from deferring its copy-out, and copying out at once frees its
        flat buffer sooner, so it finishes now; asynchronous ones stay in
        flight until the group's own hook waits for them."""
        with self.use_training_state(state):
            if self.comm.inline and not self.unshard_async_op:
                self.unshard()
                self.wait_for_unshard()
            else:
                self.unshard(self.unshard_async_op)

    def post_backward(self) -> None:
        """Reshard and reduce-scatter this group's gradients (idempotent when
        the group did not take part in the backward)."""
        self.training_state = TrainingState.POST_BACKWARD
        if self._pending is not None:  # prefetched but never used: finish it to free it
            self.wait_for_unshard()
        if not self.reduce_grads:
            for p in self.params:
                p.fold_grad_for_no_sync()
            if self.reshard_after_backward:
                self.reshard()
            return
        options = ReductionOptions(all_reduce=self.all_reduce_grads, divide_factor=self.gradient_divide_factor,
                                   reduce_scatter_unused=self.reduce_scatter_unused_params)
        owners, grads = take_unsharded_grads(self.params, options, self._partial_reduce)
        if self.reshard_after_backward:
            self.reshard()
        if grads:
            self._reduce(owners, grads, options)

    def _reduce(self, owners: list[ShardedParam], grads: list[torch.Tensor], options: ReductionOptions) -> None:
        reduce_grads(owners, grads, options, self._partial_reduce, mesh_info=self.mesh_info, comm=self.comm,
                     comms=self.comms, device=self.device, call=self._call)

    def finalize_backward(self) -> None:
        if self._pending is not None:
            self.wait_for_unshard()
            self.reshard()
        self._post_forward_indices.clear()

    def reset_iter_state(self) -> None:
        """Drop everything in flight after an exception aborted an iteration."""
        if self._pending is not None and self._pending.work is not None:
            self._pending.work.wait()
        self._pending = None
        self._partial_reduce.clear()
        self._post_forward_indices.clear()
        for p in self.params:
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None
            p.accumulated_grad = None
        self.training_state = TrainingState.IDLE
        self.reshard()

    # ------------------------------------------------------------ utilities

    def _call(self, op: str, numel: int, dtype: torch.dtype) -> D.CollectiveCall:
        return D.CollectiveCall(self.fqn, op, numel, dtype, _PHASES[self.training_state])

    @contextlib.contextmanager
    def use_training_state(self, state: TrainingState) -> Iterator[None]:
        old, self.training_state = self.training_state, state
        try:
            yield
        finally:
            self.training_state = old

    def _register_state_dict_hooks(self) -> None:
        """Save and load always see the sharded DTensors, correctly padded."""
        owners: dict[nn.Module, list[ShardedParam]] = {}
        for p in self.params:
            owners.setdefault(p.info.module, []).append(p)

        def to_sharded(*_: Any, **__: Any) -> None:
            self.reshard()

        for module, params in owners.items():
            module.register_state_dict_pre_hook(to_sharded)
            module.register_load_state_dict_pre_hook(to_sharded)
            module.register_load_state_dict_post_hook(_repad_hook(params, self))

    def __repr__(self) -> str:
        return f"ParamGroup({self.fqn}, {len(self.params)} params, {self.sharded_state.name})"


def _repad_hook(params: list[ShardedParam], group: ParamGroup):
    def hook(*_: Any) -> None:
        for p in params:
            p.reset_sharded_param()
        group.invalidate()
    return hook


class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs whose backward runs the group's post-backward."""

    @staticmethod
    def forward(ctx, group: ParamGroup, *inputs: torch.Tensor):  # type: ignore[override]
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.group.post_backward()
        return (None, *grads)
