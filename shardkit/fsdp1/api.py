"""The FSDP1 configuration vocabulary: enums and config dataclasses.

These mirror ``torch.distributed.fsdp``'s names, members, fields and defaults
so that a training script migrates by changing its imports only.  They are
plain values; what each one *does* on the shardkit core is decided in
:mod:`shardkit.fsdp1.mapping` and documented in ``docs/migration.md``.

Objects of torch's own classes are accepted wherever these are (matched by
member name or by field), so a script that changed only the
``FullyShardedDataParallel`` import keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "ShardedStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
]


class ShardingStrategy(Enum):
    """How parameters, gradients and optimizer state are split across ranks.

    On shardkit each strategy is a mesh shape plus a ``reshard_after_forward``:

    - ``FULL_SHARD`` (ZeRO-3): 1-D mesh over the group; unsharded params are
      freed after forward and gathered again for backward.
    - ``SHARD_GRAD_OP`` (ZeRO-2): 1-D mesh; unsharded params stay alive from
      forward until the end of backward, saving the backward all-gather.
    - ``NO_SHARD`` (DDP-like): a ``(world, 1)`` mesh; every rank keeps the full
      parameters and gradients are all-reduced.
    - ``HYBRID_SHARD``: a 2-D ``(replicate, shard)`` mesh; ``FULL_SHARD``
      within the shard dim, replicated (all-reduced) across the other.
    - ``_HYBRID_SHARD_ZERO2``: the same mesh with ``SHARD_GRAD_OP`` behaviour.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    """When the next backward all-gather is issued.

    - ``BACKWARD_PRE``: before the current unit's gradient computation (the
      shardkit core always prefetches in this order).
    - ``BACKWARD_POST``: after it.  Not available on shardkit; it runs as
      ``BACKWARD_PRE`` and says so once in a warning.
    - ``None`` (as the argument value): no backward prefetch.
    """

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision compute with full-precision sharded (master) parameters.

    Attributes:
        param_dtype: dtype of the unsharded parameters used in forward and
            backward.  Parameters are cast *before* the all-gather; the sharded
            parameters the optimizer steps on keep their own dtype.
        reduce_dtype: dtype of the gradient reduction.  ``None`` with a
            ``param_dtype`` reduces in ``param_dtype``, as in FSDP1.
        buffer_dtype: dtype buffers are cast to once, at construction; state
            dicts still hold them in their original dtype.
        keep_low_precision_grads: FSDP1 leaves the gradients in the reduce
            dtype.  shardkit always hands the optimizer gradients in the
            parameter's dtype and warns once when this is ``True``.
        cast_forward_inputs: every FSDP unit casts its floating-point forward
            inputs to ``param_dtype``.
        cast_root_forward_inputs: the root unit casts its forward inputs,
            regardless of ``cast_forward_inputs``.
        _module_classes_to_ignore: with an ``auto_wrap_policy``, modules of
            these classes become their own unit without mixed precision (their
            inputs are cast to float32 and their outputs back).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[torch.nn.Module]] = (_BatchNorm,)


@dataclass(frozen=True)
class CPUOffload:
    """``offload_params=True`` keeps sharded parameters and gradients on the
    CPU, so the optimizer step runs there (``CPUOffloadPolicy`` in the core)."""

    offload_params: bool = False


class StateDictType(Enum):
    """What ``module.state_dict()`` returns inside ``state_dict_type``.

    - ``FULL_STATE_DICT``: full (unsharded) tensors, gathered one at a time.
    - ``SHARDED_STATE_DICT``: ``DTensor`` values, each rank holding its shard;
      no communication.  Load them through ``torch.distributed.checkpoint`` or
      ``shardkit.checkpoint`` at any world size.
    - ``LOCAL_STATE_DICT``: FSDP1's flat-parameter shards have no equivalent
      on per-parameter sharding; shardkit returns the sharded form (warns once).
    """

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass(frozen=True)
class StateDictConfig:
    """Base of the model state-dict configs.

    Attributes:
        offload_to_cpu: move the state-dict tensors to the CPU.
    """

    offload_to_cpu: bool = False


@dataclass(frozen=True)
class FullStateDictConfig(StateDictConfig):
    """Config for ``FULL_STATE_DICT``.

    Attributes:
        rank0_only: only rank 0 receives the tensors; other ranks get ``{}``.
            Every rank still takes part in the gathers.
    """

    rank0_only: bool = False


@dataclass(frozen=True)
class LocalStateDictConfig(StateDictConfig):
    """Config for ``LOCAL_STATE_DICT`` (served as the sharded form)."""


@dataclass(frozen=True)
class ShardedStateDictConfig(StateDictConfig):
    """Config for ``SHARDED_STATE_DICT``.  Values are always ``DTensor``s;
    ``_use_dtensor`` is accepted for compatibility and has no other setting."""

    _use_dtensor: bool = False


@dataclass(frozen=True)
class OptimStateDictConfig:
    """Base of the optimizer state-dict configs.

    Attributes:
        offload_to_cpu: move the optimizer-state tensors to the CPU
            (default ``True``, as in FSDP1).
    """

    offload_to_cpu: bool = True


@dataclass(frozen=True)
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Config for full optimizer state dicts.

    Attributes:
        rank0_only: only rank 0 receives the full state; other ranks get ``{}``.
    """

    rank0_only: bool = False


@dataclass(frozen=True)
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Config for ``LOCAL_STATE_DICT`` optimizer state (served as sharded)."""

    offload_to_cpu: bool = False


@dataclass(frozen=True)
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Config for sharded optimizer state dicts (``DTensor`` values)."""

    _use_dtensor: bool = False


@dataclass(frozen=True)
class StateDictSettings:
    """The state-dict type and configs in effect for a module tree."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


class OptimStateKeyType(Enum):
    """How an optimizer state dict names its parameters: by FQN or by the
    integer ID ``torch.optim.Optimizer.state_dict()`` uses."""

    PARAM_NAME = auto()
    PARAM_ID = auto()
