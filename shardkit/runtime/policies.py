"""Mixed-precision and offload policies for :func:`shardkit.fully_shard`.

Policies are frozen dataclasses: a policy is a value that several
``fully_shard`` calls may share, and nothing in the runtime may change it
behind the user's back.  The runtime *derives* the effective dtypes per
parameter at lazy init (see ``ShardedParam.init_dtypes``), because the user
may still call ``model.to(dtype)`` between ``fully_shard`` and the first
forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardkit.errors import ConfigurationError

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "as_shardkit_policies"]


def _check_dtype(name: str, value: object) -> None:
    if value is not None and not isinstance(value, torch.dtype):
        raise ConfigurationError(
            f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, got {value!r}; "
            f"for example MixedPrecisionPolicy({name}=torch.bfloat16)"
        )
    if isinstance(value, torch.dtype) and not value.is_floating_point:
        raise ConfigurationError(
            f"MixedPrecisionPolicy.{name}={value} is not a floating-point dtype; "
            "mixed precision only casts floating-point tensors"
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes the unsharded parameters, the gradient reduction and the
    module output use.

    The sharded parameters keep their own dtype: they are the optimizer's
    master weights.  Only the copy that is all-gathered for compute is cast,
    and the cast happens *before* the all-gather, so a bf16 ``param_dtype``
    also halves the all-gather traffic.
    """

    param_dtype: torch.dtype | None = None
    """Dtype of the unsharded parameters used in forward and backward (and of
    the all-gather).  ``None`` keeps the sharded parameters' dtype."""

    reduce_dtype: torch.dtype | None = None
    """Dtype in which gradients are reduce-scattered (and all-reduced for
    HSDP), and in which gradients are accumulated across micro-batches without
    sync.  ``None`` reduces in the gradient's dtype (``param_dtype`` if set).
    fp32 here with a bf16 ``param_dtype`` keeps the sum across ranks exact to
    fp32 precision."""

    output_dtype: torch.dtype | None = None
    """Dtype the module's floating-point outputs are cast to.  ``None`` leaves
    outputs as computed."""

    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs to ``param_dtype`` so that the first
    op does not mix dtypes."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
        if not isinstance(self.cast_forward_inputs, bool):
            raise ConfigurationError(
                f"MixedPrecisionPolicy.cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}"
            )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state live on
    the mesh's device.  Use :class:`CPUOffloadPolicy` to keep them on the CPU."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on the CPU; the optimizer then
    steps on the CPU too.

    Before each all-gather the shard is copied to the mesh's device (cast to
    ``param_dtype`` on the way); after each reduce-scatter the sharded gradient
    is copied back.  This trades host-device bandwidth for device memory: only
    the unsharded parameters and gradients of the groups being computed live
    on the device.  On a CPU mesh both copies are no-ops.
    """

    pin_memory: bool = True
    """Pin the CPU shards so host-device copies can be asynchronous.  Ignored
    when no accelerator is present (pinning needs one)."""

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise ConfigurationError(
                f"CPUOffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}"
            )


def as_shardkit_policies(mp_policy: Any, offload_policy: Any) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """shardkit's policies, or torch's own (``torch.distributed.fsdp.MixedPrecisionPolicy``,
    ``OffloadPolicy``, ``CPUOffloadPolicy``) taken field for field, so code written for
    torch's ``fully_shard`` runs unchanged after swapping only the ``fully_shard`` import."""
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        if not _is_torch_policy(mp_policy, "MixedPrecisionPolicy"):
            raise ConfigurationError(
                f"mp_policy must be a MixedPrecisionPolicy (shardkit's or torch's), got {type(mp_policy).__name__}"
            )
        mp_policy = MixedPrecisionPolicy(mp_policy.param_dtype, mp_policy.reduce_dtype, mp_policy.output_dtype,
                                         mp_policy.cast_forward_inputs)
    if not isinstance(offload_policy, OffloadPolicy):
        if _is_torch_policy(offload_policy, "CPUOffloadPolicy"):
            offload_policy = CPUOffloadPolicy(pin_memory=offload_policy.pin_memory)
        elif _is_torch_policy(offload_policy, "OffloadPolicy"):
            offload_policy = OffloadPolicy()
        else:
            raise ConfigurationError(
                "offload_policy must be OffloadPolicy() or CPUOffloadPolicy() (shardkit's or torch's), "
                f"got {type(offload_policy).__name__}"
            )
    return mp_policy, offload_policy


def _is_torch_policy(value: Any, name: str) -> bool:
    cls = type(value)
    return cls.__name__ == name and cls.__module__.startswith("torch.distributed.fsdp")
