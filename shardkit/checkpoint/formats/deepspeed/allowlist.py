"""The classes a DeepSpeed checkpoint's pickles name, and the inert stand-ins shardkit rebuilds them as.

DeepSpeed writes its checkpoints with ``torch.save`` of plain dicts, tensors
and a few of its own objects.  Those objects fail ``torch.load(weights_only=
True)``, and importing DeepSpeed to unpickle them would run its code (and
need it installed).  So the files are read with torch's allowlisting
unpickler, extended by exactly these names, each rebuilt as a stand-in that
holds the pickled fields and does nothing else.  The names are those the
ZeRO optimizers (stages 1-3, fp16/bf16/fp32) put into ``*_optim_states.pt``:

* ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` and ``DynamicLossScaler``
  (the loss scale; its fields are kept as data);
* ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an ``int`` enum: the stage);
* ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``/``start`` of
  each parameter's slice of a rank's partition, stages 1 and 2).

Model-state files need nothing beyond torch's own allowlist.  A file naming
any other class (an ``argparse.Namespace`` the user stored as ``client_state``,
anything executable) is refused, and the refusal names the class.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["SAFE_GLOBALS", "ALLOWED_CLASSES", "StandIn", "ZeroStage"]


class StandIn:
    """An allowlisted DeepSpeed object, rebuilt as data: the fields the pickle sets, nothing run."""

    def fields(self) -> dict[str, Any]:
        return dict(vars(self))


class LossScaler(StandIn):
    """``deepspeed.runtime.fp16.loss_scaler.LossScaler``: a static loss scale (``cur_scale``)."""


class DynamicLossScaler(StandIn):
    """``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``: the loss scale and its schedule."""


class FragmentAddress(StandIn):
    """``deepspeed.utils.tensor_fragment.fragment_address``: where a parameter's slice sits in a partition."""


class ZeroStage(int):
    """``deepspeed.runtime.zero.config.ZeroStageEnum(n)``: the ZeRO stage, as the int it is."""


ALLOWED_CLASSES: dict[str, Callable] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}

# the form torch.serialization.safe_globals takes: (stand-in, the name the pickle uses)
SAFE_GLOBALS: tuple[tuple[Callable, str], ...] = tuple((cls, name) for name, cls in ALLOWED_CLASSES.items())
