"""One parameter under ``fully_shard``: its shard, its padding, and its
unsharded twin.

Note [the tensors of one parameter]
    ``padded``      this rank's rows, zero-padded to ``ceil(S0 / W)`` rows so
                    that every rank sends the same number of elements to the
                    all-gather.  Flattened, it *is* the all-gather input: no
                    copy is needed to pad before each collective.
    ``sharded``     an ``nn.Parameter(DTensor)`` whose local tensor is
                    ``padded.narrow(0, 0, real_rows)``: the optimizer, the
                    state dict and ``clip_grad_norm_`` see the true global
                    shape and never the padding.
    ``buffer``      1-D, ``W * padded.numel()`` elements in the compute dtype:
                    the padded full tensor, contiguous along the shard dim.
                    Its storage is freed (``resize_(0)``) when resharded and
                    re-allocated when unsharded; views of it stay valid.
    ``unsharded``   an ``nn.Parameter`` viewing ``buffer`` with the original
                    shape, built once and reused every iteration.  Autograd
                    saves references to it, which survive the storage being
                    freed and refilled (see ``ParamGroup`` for the version
                    counter).

A parameter that tensor parallelism made a DTensor is handled through its
TP-local tensor: ``padded``, ``buffer`` and the gradients are TP-local,
``sharded`` lives on the composed (dp, tp) mesh and ``unsharded`` is the
TP DTensor again (see Note [composing FSDP with TP] in ``tensor_parallel``).

Only ``sharded`` is registered on the module at rest; ``unsharded`` is
registered, straight into ``module._parameters``, while the group computes.
Where the rows and the padding lie is :mod:`.shard_layout`'s arithmetic.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardkit.errors import ReplacedParameterError, TrainingStateError
from shardkit.runtime.mesh_info import MeshInfo
from shardkit.runtime.policies import MixedPrecisionPolicy
from shardkit.runtime.shard_layout import ShardLayout, check_shardable
from shardkit.runtime.spmd_mesh import spmd_layout
from shardkit.runtime.tensor_parallel import make_spec, tp_layout
from shardkit.runtime.torch_names import TorchParamNames

__all__ = ["ShardedState", "ParamModuleInfo", "ShardedParam", "alloc_storage", "free_storage", "check_materialized"]


class ShardedState(enum.Enum):
    SHARDED = "sharded"                            # only the shard exists
    SHARDED_POST_FORWARD = "sharded_post_forward"  # a 1/k slice kept for backward
    UNSHARDED = "unsharded"                        # the full parameter is registered


@dataclass
class ParamModuleInfo:
    """Where a parameter is registered: its owning module and name, plus every
    other module that shares the same Parameter object (tied weights)."""

    module: nn.Module
    name: str
    shared: list[tuple[nn.Module, str]] = field(default_factory=list)

    def register(self, param: nn.Parameter) -> None:
        # Straight into ``_parameters``: nn.Module.__setattr__ costs several
        # microseconds per call and checks nothing we need here.
        for module, name in [(self.module, self.name), *self.shared]:
            if type(module).__setattr__ is nn.Module.__setattr__:
                module._parameters[name] = param
            else:
                setattr(module, name, param)


def alloc_storage(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.itemsize
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _pin_available() -> bool:
    return torch.cuda.is_available()


class ShardedParam(TorchParamNames):
    """The shard, padding and unsharded view of one parameter of a group."""

    def __init__(self, param: nn.Parameter, info: ParamModuleInfo, mesh_info: MeshInfo,
                 device: torch.device, shard_dim: int, offload: bool, pin_memory: bool) -> None:
        self.info = info
        self.mesh_info = mesh_info
        self.device = device
        self.offload = offload
        self.pin_memory = pin_memory and offload and _pin_available()
        self.fqn = f"{type(info.module).__name__}.{info.name}"  # refined at lazy init
        self.param_dtype: torch.dtype | None = None   # None: compute in orig dtype
        self.reduce_dtype: torch.dtype | None = None  # None: reduce in grad dtype
        self.buffer: torch.Tensor | None = None
        self.unsharded_param: nn.Parameter | None = None
        self.accumulated_grad: torch.Tensor | None = None
        self.post_forward_data: torch.Tensor | None = None
        self.state = ShardedState.SHARDED
        self._init_sharded(param, shard_dim)

    # ------------------------------------------------------------------ init

    @torch.no_grad()
    def _init_sharded(self, param: nn.Parameter, shard_dim: int) -> None:
        name = self.fqn
        # A tensor-parallel DTensor is sharded through its TP-local tensor (Note
        # [composing FSDP with TP]); everything below works on that local data.
        is_tp = isinstance(param, DTensor)
        data = param._local_tensor if is_tp else param.detach()
        shard_dim = check_shardable(param, data, shard_dim, self.info.name, name)
        if self.mesh_info.spmd is not None:  # Note [the full SPMD mesh]
            self.tp = spmd_layout(param, self.mesh_info, shard_dim, self.info.name)
        else:
            self.tp = tp_layout(param, self.mesh_info, shard_dim, f"parameter {name}") if is_tp else None
        self.layout = layout = ShardLayout.of(data.shape, shard_dim, self.mesh_info.shard_size,
                                              self.mesh_info.shard_rank, name)
        # the sizes the group and its collectives read, fixed for the parameter's life
        self.shard_dim, self.orig_size, self.numel = layout.shard_dim, layout.orig_size, layout.numel
        self.padded_size, self.padded_numel = layout.padded_size, layout.padded_numel
        self.real_rows, self.sharded_size = layout.real_rows, layout.sharded_size
        self.requires_grad = param.requires_grad

        padded = self._new_padded(data, self.device)
        if self.real_rows > 0:
            layout.unpadded(padded).copy_(layout.rows_of(data))
        self.padded = padded.view(-1)
        local = layout.unpadded(padded)
        if self.tp is not None:
            mesh, placements = self.tp.mesh, self.tp.placements
        else:
            mesh, placements = self.mesh_info.mesh, self.mesh_info.placements_for(shard_dim)
        self.spec = make_spec(mesh, placements, param.shape, data.dtype)
        self.sharded_param = nn.Parameter(DTensor(local, self.spec, requires_grad=False),
                                          requires_grad=param.requires_grad)
        self.sharded_param._local_tensor = local  # the view into ``padded``, not a copy
        # registered on the module by fully_shard once every parameter of the group is built

    def _new_padded(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        if like.is_meta:
            device = like.device
        elif self.offload:
            device = torch.device("cpu")
        padded = torch.zeros(self.padded_size, dtype=like.dtype, device=device)
        if self.pin_memory and not padded.is_meta:
            padded = padded.pin_memory()
        return padded

    def init_dtypes(self, policy: MixedPrecisionPolicy) -> None:
        """Clamp the policy to this parameter: ``None`` means "no cast"."""
        orig = self.sharded_param.dtype
        param_dtype, reduce_dtype = policy.param_dtype, policy.reduce_dtype
        if param_dtype == orig or not orig.is_floating_point:
            param_dtype = None
        if reduce_dtype == (param_dtype or orig):
            reduce_dtype = None
        if param_dtype != self.param_dtype and self.buffer is not None:
            self._drop_unsharded()
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    @property
    def orig_dtype(self) -> torch.dtype:
        return self.sharded_param.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype or self.sharded_param.dtype

    # ------------------------------------------------------------ re-padding

    @torch.no_grad()
    def reset_sharded_param(self) -> None:
        """Re-pad after anything replaced the shard's storage: ``module.to(...)``,
        ``to_empty`` after meta init, or ``load_state_dict(assign=True)``.

        The registered parameter is authoritative; if its local tensor is no
        longer a view into ``padded``, a new padded buffer is made from it."""
        current = getattr(self.info.module, self.info.name)
        if current is not self.sharded_param:
            self.check_replacement()
            self.sharded_param = current
            self.requires_grad = current.requires_grad
            self.info.register(current)
        local = self.sharded_param._local_tensor
        self.spec = self.sharded_param._spec
        if local.is_meta:
            return
        same = (not self.padded.is_meta and self.padded.dtype == local.dtype
                and self.padded.device == local.device and self.padded.numel() > 0
                and self.padded.untyped_storage().data_ptr() == local.untyped_storage().data_ptr())
        if same:
            return
        dtype_changed = self.padded.dtype != local.dtype or self.padded.device != local.device
        padded = self._new_padded(local, local.device)
        if self.real_rows > 0:
            self.layout.unpadded(padded).copy_(local)
        self.padded = padded.view(-1)
        self.sharded_param._local_tensor = self.layout.unpadded(padded)
        if dtype_changed:
            self._drop_unsharded()

    def check_replacement(self) -> None:
        """A parameter set on the module after ``fully_shard`` (``module.w = nn.Parameter(d)``,
        ``load_state_dict(assign=True)``) is taken as the new shard, as torch takes it, only
        if it is this rank's shard in the old one's layout: a plain tensor could be the full
        tensor or this rank's rows, and another layout would be all-gathered wrongly."""
        new = getattr(self.info.module, self.info.name)
        if new is self.sharded_param:
            return
        howto = ("build it as a DTensor in the parameter's layout: nn.Parameter(distribute_tensor("
                 "full, param.device_mesh, param.placements)), or compute it from the other sharded "
                 "parameters (DTensor ops keep their layout)")
        if not isinstance(new, DTensor):
            raise ReplacedParameterError(
                f"parameter {self.fqn} was replaced by a {type(new).__name__} that is not a DTensor; "
                f"a sharded module takes this rank's shard as a DTensor: {howto}"
            )
        old = self.spec
        if (new.device_mesh != old.mesh or tuple(new.placements) != tuple(old.placements)
                or new.shape != old.shape):
            raise ReplacedParameterError(
                f"parameter {self.fqn} was replaced by a DTensor of shape {tuple(new.shape)} with "
                f"placements {tuple(new.placements)} on {new.device_mesh}; it is sharded as shape "
                f"{tuple(old.shape)} with placements {tuple(old.placements)} on {old.mesh}: {howto}"
            )

    def _drop_unsharded(self) -> None:
        self.buffer = None
        self.unsharded_param = None
        self.accumulated_grad = None

    # ---------------------------------------------------------- unsharding

    def all_gather_input(self) -> torch.Tensor:
        """The flat tensor this rank contributes (its dtype may still need a cast)."""
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            return self.post_forward_data
        if self.offload and self.device.type != "cpu":
            return self.padded.to(self.device, non_blocking=True)
        return self.padded

    def alloc_unsharded(self) -> torch.Tensor:
        """Allocate (or re-allocate) the padded full buffer; returns it."""
        if self.buffer is None:
            world = self.mesh_info.shard_size
            self.buffer = torch.empty(world * self.padded_numel, dtype=self.compute_dtype, device=self.device)
            view = self.layout.unsharded_view(self.buffer)
            unsharded = self.tp.unsharded(view) if self.tp is not None else view
            self.unsharded_param = nn.Parameter(unsharded, requires_grad=self.sharded_param.requires_grad)
        else:
            alloc_storage(self.buffer)
        return self.buffer

    def copy_out_view(self, world: int) -> torch.Tensor:
        """A ``(world, ...)`` view of ``buffer`` into which row ``r`` of the
        rank-major all-gather output is copied."""
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            return self.buffer.view(world, -1)
        return self.layout.rank_major_view(self.buffer, world)

    @property
    def shard_dim_copy(self) -> bool:
        """Whether copy-out needs the strided (non dim-0) path."""
        return self.shard_dim != 0 and self.state is not ShardedState.SHARDED_POST_FORWARD

    def to_unsharded(self) -> None:
        param = self.unsharded_param
        if param.requires_grad != self.sharded_param.requires_grad:
            param.requires_grad_(self.sharded_param.requires_grad)
        self.info.register(param)
        self.post_forward_data = None
        self.state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        self.info.register(self.sharded_param)
        if self.buffer is not None:
            free_storage(self.buffer)
        self.post_forward_data = None
        self.state = ShardedState.SHARDED

    def to_sharded_post_forward(self, size: int, rank: int) -> None:
        """Keep a ``1/size`` slice of the full buffer for the backward all-gather."""
        part = self.buffer.numel() // size
        self.post_forward_data = self.buffer.narrow(0, part * rank, part).clone()
        self.info.register(self.sharded_param)
        free_storage(self.buffer)
        self.state = ShardedState.SHARDED_POST_FORWARD

    def is_unsharded_allocated(self) -> bool:
        return self.buffer is not None and self.buffer.untyped_storage().size() > 0

    # --------------------------------------------------------------- grads

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The gradient to reduce (accumulated in ``reduce_dtype`` if it was
        kept across unsynced micro-batches); clears it from the unsharded param."""
        param = self.unsharded_param
        if param is None:
            return None
        grad = self._local_grad(param.grad)
        param.grad = None
        if self.accumulated_grad is not None:
            accumulated, self.accumulated_grad = self.accumulated_grad, None
            if grad is not None:
                accumulated += grad
            return accumulated
        return grad

    def _local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient FSDP reduces: the TP-local tensor for a TP parameter."""
        if grad is None or self.tp is None:
            return grad
        return self.tp.local_grad(grad)

    def fold_grad_for_no_sync(self) -> None:
        """Without sync, keep the grad for the next micro-batch, upcast to the
        reduce dtype so the accumulation is as exact as the reduction."""
        param = self.unsharded_param
        if param is None or param.grad is None:
            return
        if self.accumulated_grad is not None:
            self.accumulated_grad += self._local_grad(param.grad)
            param.grad = None
        elif self.reduce_dtype is not None and param.grad.dtype != self.reduce_dtype:
            self.accumulated_grad = self._local_grad(param.grad).to(self.reduce_dtype)
            param.grad = None

    def has_pending_grad(self) -> bool:
        param = self.unsharded_param
        return self.accumulated_grad is not None or (param is not None and param.grad is not None)

    def zero_unsharded_grad(self) -> torch.Tensor:
        return torch.zeros(self.orig_size, dtype=self.compute_dtype, device=self.device)

    @torch.no_grad()
    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Set or add the reduced shard (a view of the reduce-scatter output)."""
        if self.offload and local_grad.device.type != "cpu":
            # blocking: the CPU optimizer reads it right after backward
            local_grad = local_grad.to("cpu")
        if local_grad.dtype != self.orig_dtype:
            local_grad = local_grad.to(self.orig_dtype)
        param = self.sharded_param
        if param.grad is None:
            param.grad = DTensor(local_grad, self.spec, requires_grad=False)
        else:
            param.grad._local_tensor.add_(local_grad)
        hooks = getattr(param, "_post_accumulate_grad_hooks", None)
        if hooks:
            for hook in hooks.values():
                hook(param)

    def __repr__(self) -> str:
        return f"ShardedParam({self.fqn}, size={tuple(self.orig_size)}, state={self.state.name})"


def check_materialized(params: list[ShardedParam]) -> None:
    """Before the first all-gather, every shard must be real memory, on the CPU under CPU
    offloading (torch's RuntimeErrors and words, then what else works)."""
    on_meta = [p.fqn for p in params if p.sharded_param.is_meta]
    if on_meta:
        raise TrainingStateError(
            "FSDP parameters should be materialized from meta device before training, "
            f"but the following were still on meta device: {on_meta}\n"
            "For example, call module.to_empty(device) to materialize to device and "
            "call module.reset_parameters() on each module to initialize values. "
            "Loading a state dict (load_state_dict(..., assign=True)) materializes them too."
        )
    off_cpu = [(p.fqn, p.sharded_param.device) for p in params if p.offload and p.sharded_param.device.type != "cpu"]
    if off_cpu:
        raise TrainingStateError(
            "FSDP parameters should be materialized on CPU when enabling CPU offloading. "
            'For example, load a CPU state dict or call module.to_empty(device="cpu"). '
            f"Found following parameters on non-CPU device: {off_cpu}\n"
            "CPU offloading keeps the shards on the CPU."
        )
