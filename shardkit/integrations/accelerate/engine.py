"""Accelerate's four FSDP checkpoint functions, with shardkit writing and reading the sharded FSDP2 state.

``Accelerator.save_state``/``load_state`` and the Trainer's checkpoints call
``save_fsdp_model``, ``save_fsdp_optimizer``, ``load_fsdp_model`` and
``load_fsdp_optimizer`` (module ``accelerate.utils.fsdp_utils``).  The functions
here have the same signatures and write the same folders --
``pytorch_model_fsdp_<i>/`` and ``optimizer_<i>/`` in the checkpoint
directory -- but each folder is a native shardkit checkpoint: the model as
``{"model": {fqn: DTensor}}``, the optimizer as ``{"optim": {"state": {fqn:
...}, "param_groups": [...]}}`` (shardkit's FQN-keyed form, so both load at
any world size), with checksums, no pickle, and an atomic commit.

What shardkit writes: FSDP2 with ``SHARDED_STATE_DICT`` (the DCP path).  What
it reads: any folder holding a native checkpoint, into an FSDP2 model (an FSDP1
model is refused, naming the folder).  Everything else -- FSDP1,
``FULL_STATE_DICT`` files, ``use_dcp=False`` per-rank files, PEFT adapters
saved alone, and the DCP folders written before the switch -- goes to
Accelerate's own function, unchanged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from shardkit.checkpoint import (  # resolved now, not inside a job's first timed save or resume
    load as shardkit_load,
)
from shardkit.checkpoint import (
    save as shardkit_save,
)
from shardkit.checkpoint.formats import NATIVE
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state_dict import (
    apply_model_state,
    apply_optimizer_state,
    live_model_state,
    live_optimizer_state,
)
from shardkit.errors import ConfigurationError
from shardkit.integrations.requirements import import_framework

__all__ = ["NAMES", "ORIGINALS", "REPLACEMENTS", "EngineOptions", "OPTIONS", "save_fsdp_model", "load_fsdp_model",
           "save_fsdp_optimizer", "load_fsdp_optimizer", "model_folder", "optimizer_folder", "holds_shardkit"]

logger = logging.getLogger(__name__)

_fsdp_utils = import_framework("accelerate.utils.fsdp_utils", "accelerate")
_constants = import_framework("accelerate.utils.constants", "accelerate")
_optimizer_module = import_framework("accelerate.optimizer", "accelerate")
_modeling = import_framework("accelerate.utils.modeling", "accelerate")

NAMES = ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")
# Accelerate's own functions, taken before anything replaces them: the fallback, and what the undo puts back
ORIGINALS: dict[str, Callable[..., Any]] = {name: getattr(_fsdp_utils, name) for name in NAMES}


@dataclass
class EngineOptions:
    """How the replaced functions save and load (set by ``use_shardkit``)."""

    compression: str | None = None
    io_threads: int | None = None
    verify_first: bool = False
    save_options: dict[str, Any] = field(default_factory=dict)

    def for_save(self) -> dict[str, Any]:
        options = dict(self.save_options)
        if self.compression is not None:
            options["compression"] = self.compression
        if self.io_threads is not None:
            options["io_threads"] = self.io_threads
        return options

    def for_load(self) -> dict[str, Any]:
        options: dict[str, Any] = {"verify_first": self.verify_first}
        if self.io_threads is not None:
            options["io_threads"] = self.io_threads
        return options


OPTIONS = EngineOptions()


def model_folder(directory: str | os.PathLike, index: int) -> str:
    """Where model ``index`` lives: ``DIR/pytorch_model_fsdp_<i>``, or ``DIR`` itself when it is that folder
    (Accelerate's loaders accept both)."""
    return _part(directory, _constants.FSDP_MODEL_NAME, index)


def optimizer_folder(directory: str | os.PathLike, index: int) -> str:
    """Where optimizer ``index`` lives: ``DIR/optimizer_<i>`` (or ``DIR`` itself, as for the model)."""
    return _part(directory, _constants.OPTIMIZER_NAME, index)


def _part(directory: str | os.PathLike, prefix: str, index: int) -> str:
    name = f"{prefix}_{index}"
    directory = os.fspath(directory)
    return directory if os.path.basename(os.path.normpath(directory)) == name else os.path.join(directory, name)


def holds_shardkit(path: str) -> bool:
    """Whether ``path`` holds a committed native shardkit checkpoint (else: DCP, or nothing)."""
    return os.path.isdir(path) and NATIVE.detect(Storage(path))


def _sharded_fsdp2(fsdp_plugin: Any) -> bool:
    from torch.distributed.fsdp import StateDictType

    return fsdp_plugin.fsdp_version == 2 and fsdp_plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT


def _adapter_alone(model: torch.nn.Module, adapter_only: bool) -> bool:
    """A PEFT model saved as its adapter only: PEFT's own keys, which Accelerate's path writes."""
    return adapter_only and _modeling.is_peft_model(model)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper (whose ``step`` also syncs gradients and the scaler)."""
    return optimizer.optimizer if isinstance(optimizer, _optimizer_module.AcceleratedOptimizer) else optimizer


def _check_loadable(path: str, fsdp_plugin: Any, *, adapter_alone: bool) -> None:
    """A shardkit folder loads into an FSDP2 model (Accelerate's own loaders read only DCP or torch.save
    files, so they would fail on it with a message about a missing ``.metadata``): say so, naming it."""
    if fsdp_plugin.fsdp_version != 2:
        raise ConfigurationError(f"{path} is a shardkit checkpoint, which loads into FSDP2 models; this accelerator "
                                 f"uses FSDP{fsdp_plugin.fsdp_version}: set fsdp_version=2, or convert the folder "
                                 "with `shardkit convert`")
    if adapter_alone:
        raise ConfigurationError(f"{path} is a shardkit checkpoint of the whole model; Accelerate was asked for a "
                                 "PEFT adapter alone (adapter_only=True), which shardkit does not write: load it "
                                 "with adapter_only=False")


def _no_missing_keys() -> Any:
    """What ``load_state_dict`` returns when every key matched (the Trainer reads it after a load)."""
    return torch.nn.modules.module._IncompatibleKeys([], [])


def save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, model_index=0, adapter_only=False,  # noqa: ANN001
                    use_dcp=True):
    """Accelerate's ``save_fsdp_model``: FSDP2 sharded state as a shardkit checkpoint in
    ``output_dir/pytorch_model_fsdp_<i>``; any other case by Accelerate's own function."""
    if not (use_dcp and _sharded_fsdp2(fsdp_plugin)) or _adapter_alone(model, adapter_only):
        return ORIGINALS["save_fsdp_model"](fsdp_plugin, accelerator, model, output_dir, model_index,
                                            adapter_only, use_dcp)
    path = os.path.join(os.fspath(output_dir), f"{_constants.FSDP_MODEL_NAME}_{model_index}")
    logger.info("saving model %d to %s through shardkit", model_index, path)
    shardkit_save({"model": live_model_state(model)}, path, **OPTIONS.for_save())
    return None


def load_fsdp_model(fsdp_plugin, accelerator, model, input_dir, model_index=0, adapter_only=False,  # noqa: ANN001
                    use_dcp=True):
    """Accelerate's ``load_fsdp_model``: a shardkit checkpoint in ``input_dir/pytorch_model_fsdp_<i>`` loads
    into the FSDP2 model at any world size; anything else (a DCP folder, a full state dict file) by
    Accelerate's own function."""
    path = model_folder(input_dir, model_index)
    if not holds_shardkit(path):
        return ORIGINALS["load_fsdp_model"](fsdp_plugin, accelerator, model, input_dir, model_index,
                                            adapter_only, use_dcp)
    _check_loadable(path, fsdp_plugin, adapter_alone=_adapter_alone(model, adapter_only))
    logger.info("loading model %d from %s through shardkit", model_index, path)
    state = {"model": live_model_state(model)}
    shardkit_load(state, path, **OPTIONS.for_load())
    apply_model_state(model, state["model"])  # in place already: checks the keys, copies nothing
    return _no_missing_keys()


def save_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index=0,  # noqa: ANN001
                        use_dcp=True):
    """Accelerate's ``save_fsdp_optimizer``: FSDP2 sharded optimizer state, keyed by parameter FQN, as a
    shardkit checkpoint in ``output_dir/optimizer_<i>``; any other case by Accelerate's own function."""
    if not (use_dcp and _sharded_fsdp2(fsdp_plugin)):
        return ORIGINALS["save_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model, output_dir,
                                                optimizer_index, use_dcp)
    path = os.path.join(os.fspath(output_dir), f"{_constants.OPTIMIZER_NAME}_{optimizer_index}")
    logger.info("saving optimizer %d to %s through shardkit", optimizer_index, path)
    shardkit_save({"optim": live_optimizer_state(model, _torch_optimizer(optimizer))}, path, **OPTIONS.for_save())
    return None


def load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=0,  # noqa: ANN001
                        adapter_only=False, use_dcp=True):
    """Accelerate's ``load_fsdp_optimizer``: a shardkit checkpoint in ``input_dir/optimizer_<i>`` loads into
    the optimizer of the FSDP2 model at any world size; anything else by Accelerate's own function."""
    path = optimizer_folder(input_dir, optimizer_index)
    if not holds_shardkit(path):
        return ORIGINALS["load_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model, input_dir,
                                                optimizer_index, adapter_only, use_dcp)
    _check_loadable(path, fsdp_plugin, adapter_alone=False)
    logger.info("loading optimizer %d from %s through shardkit", optimizer_index, path)
    inner = _torch_optimizer(optimizer)
    state = {"optim": live_optimizer_state(model, inner)}
    shardkit_load(state, path, **OPTIONS.for_load())
    apply_optimizer_state(model, inner, state["optim"])  # the hyper-parameters, the scheduler's lr included
    return None


REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "save_fsdp_model": save_fsdp_model, "load_fsdp_model": load_fsdp_model,
    "save_fsdp_optimizer": save_fsdp_optimizer, "load_fsdp_optimizer": load_fsdp_optimizer,
}
