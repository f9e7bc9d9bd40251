"""The state dict a torchtitan step is saved as and loaded into, in the names shardkit gives it.

torchtitan's DCP manager saves its model keys at the top level beside
``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state``.  shardkit
reads such a DCP folder with the model under ``model.*`` and the optimizer
under ``optim.*`` (docs/cli.md), so this module saves the same names natively:
one target dict then loads a step written by either engine, and ``shardkit
convert --to hf`` or ``inspect`` understand a torchtitan step as they do any
shardkit checkpoint.

The data loader is the one per-rank state: torchtitan's keeps each data-parallel
rank's position under ``dp_rank_<r>`` as pickle bytes.  shardkit stores no
pickle, so the position is taken from under the pickle (``StatefulDataLoader``'s
own state dict, JSON types), gathered from every rank and stored as one JSON
text that rank 0 writes.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.state.dcp_stateful import stateful_to_state_dict
from shardkit.checkpoint.state.tree import flatten, to_json_value
from shardkit.errors import DataStateError
from shardkit.wire.collectives import all_gather_json

__all__ = ["MODEL_KEY", "OPTIM_KEY", "DATALOADER_KEY", "saved_names", "training_state", "flat_keys", "model_state",
           "dataloader_text", "restore_dataloader", "cast_floating"]

log = logging.getLogger(__name__)

MODEL_KEY, OPTIM_KEY, DATALOADER_KEY = "model", "optim", "dataloader"
_TORCHTITAN_OPTIMIZER = "optimizer"  # torchtitan's name for the optimizer state, saved as OPTIM_KEY


def saved_names(states: Mapping[str, Any]) -> dict[str, str]:
    """torchtitan's state name -> the top-level key it is saved under."""
    return {name: OPTIM_KEY if name == _TORCHTITAN_OPTIMIZER else name for name in states}


def model_state(model_wrapper: Any, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The model's FQN-keyed tensors (torchtitan's ``ModelWrapper``), cast to ``dtype`` for an export."""
    state = model_wrapper.state_dict()
    return cast_floating(state, dtype) if dtype is not None else state


def cast_floating(state: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``state`` with every floating tensor of another dtype cast to ``dtype`` (torchtitan's ``export_dtype``)."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype else v
            for k, v in state.items()}


def training_state(states: Mapping[str, Any], *, model_only: bool, exclude: tuple[str, ...] = (),
                   for_save: bool) -> dict[str, Any]:
    """The dict handed to shardkit's ``save``/``load``: every torchtitan state under its saved name.

    ``Stateful`` values (``ModelWrapper``, ``OptimizersContainer``,
    ``LRSchedulersContainer``, the trainer's ``train_state``) stay objects: the
    load hands each its loaded state through ``load_state_dict``, as DCP does.
    The data loader becomes its JSON text (:func:`dataloader_text`) on a save,
    and an empty text to be replaced on a load.  ``exclude`` names torchtitan
    states not to load (``exclude_from_loading``)."""
    names = saved_names(states)
    out: dict[str, Any] = {}
    for name, value in states.items():
        if name in exclude or value is None or (model_only and name != MODEL_KEY):
            continue
        if name == DATALOADER_KEY:
            out[names[name]] = dataloader_text(value) if for_save else ""
        else:
            out[names[name]] = value
    return out


def flat_keys(state: dict[str, Any]) -> list[str]:
    """The checkpoint keys a load of ``state`` (:func:`training_state`) fills, as shardkit flattens them."""
    flat = flatten(stateful_to_state_dict(state))
    return [*flat.tensors, *flat.values]


def _position(dataloader: Any) -> tuple[Any, int | None]:
    """A data loader's own state as JSON types, and its data-parallel width when it has one.

    torchtitan's ``ParallelAwareDataloader`` pickles ``StatefulDataLoader``'s
    state dict into bytes; that state dict itself is what is kept here."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    if isinstance(dataloader, StatefulDataLoader) and hasattr(dataloader, "dp_world_size"):
        return StatefulDataLoader.state_dict(dataloader), int(dataloader.dp_world_size)
    if isinstance(dataloader, Stateful):
        return dataloader.state_dict(), None
    raise DataStateError(f"{DATALOADER_KEY!r}: a {type(dataloader).__name__} has no state_dict(); pass a torchtitan "
                         "BaseDataLoader, or exclude it with checkpoint.exclude_from_loading")


def dataloader_text(dataloader: Any) -> str:
    """Every rank's data position as one JSON text (collective when a process group exists)."""
    position, width = _position(dataloader)
    mine = json.dumps(to_json_value(position, DATALOADER_KEY))
    every = all_gather_json(mine) if dist.is_available() and dist.is_initialized() else [mine]
    return json.dumps({"world_size": len(every), "dp_world_size": width, "ranks": every})


def restore_dataloader(dataloader: Any, text: str, where: str) -> None:
    """Put this rank's data position from ``text`` (:func:`dataloader_text`) back into ``dataloader``.

    The position of a data-parallel rank belongs to the world size that saved
    it; torchtitan refuses another one, and so does this (naming the step):
    exclude the data loader from loading to resume at another size."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    if not text:
        log.info("%s holds no data loader position; the data loader starts from its beginning", where)
        return
    stored = json.loads(text)
    here = Dist()
    rank, world = here.rank, here.world_size
    if stored["world_size"] != world:
        raise DataStateError(f"{where}: {DATALOADER_KEY!r} holds the data positions of {stored['world_size']} "
                             f"ranks, this job has {world}; a data-parallel rank's position does not carry over "
                             f"to another world size. Add {DATALOADER_KEY!r} to checkpoint.exclude_from_loading "
                             "to resume the model, optimizer and schedule without it")
    position = json.loads(stored["ranks"][rank])
    if isinstance(dataloader, StatefulDataLoader) and hasattr(dataloader, "dp_world_size"):
        StatefulDataLoader.load_state_dict(dataloader, position)
    else:
        dataloader.load_state_dict(position)
