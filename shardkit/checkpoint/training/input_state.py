"""The input state a checkpoint step holds (``data.*`` and ``rng.*``: shardkit.data), read and checked
before a resume writes any model or optimizer tensor, so a refusal leaves the run as it was; and where in
the step the model and optimizer state lie (at the top, or under a torch DCP ``AppState``'s name)."""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.tree import from_json_value
from shardkit.checkpoint.training.load import open_checkpoint
from shardkit.data import ElasticSampler, Stateful, check_data_state_dict, nest
from shardkit.errors import ConfigurationError, DataStateError
from shardkit.wire.collectives import raise_any_failure

__all__ = ["INPUT_KEYS", "stored_input_state", "stored_step", "check_input_state"]

INPUT_KEYS = ("data", "rng")  # top-level keys of resumable input state (shardkit.data), beside model and optim

log = logging.getLogger(__name__)


def stored_input_state(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Load targets for the ``data.*`` and ``rng.*`` keys a checkpoint holds, nested.

    Which keys exist depends on the world size that saved (one RNG state per
    rank), so the targets are built from the checkpoint itself: an empty
    tensor of the stored dtype and shape per tensor key, the stored value per
    value key (``load`` fills both in place).
    """
    return _read_step(url, storage_options)[0]


def stored_step(url: str, from_dcp: str | None = None,
                storage_options: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], str | None]:
    """The targets of the step's input state (:func:`stored_input_state`), and the name model and optimizer
    state lie under in it: ``from_dcp`` where the step holds keys below that name -- a torch DCP checkpoint
    saved as the DCP tutorial does, ``dcp.save({"app": AppState(model, optimizer)})``, holds ``app.model.*``
    and ``app.optim.*`` (``from_dcp="app"``) -- else ``None``: at the top, where the manager saves them."""
    if from_dcp is not None and (not isinstance(from_dcp, str) or not from_dcp or "." in from_dcp
                                 or from_dcp in ("model", "optim", *INPUT_KEYS)):
        raise ConfigurationError(f"from_dcp must name the top-level key a torch DCP loop saved model and optimizer "
                                 f"state under (e.g. 'app' for dcp.save({{'app': AppState(...)}})), without dots, "
                                 f"and neither 'model', 'optim', 'data' nor 'rng'; got {from_dcp!r}")
    inputs, roots = _read_step(url, storage_options)
    return inputs, from_dcp if from_dcp in roots else None


def _read_step(url: str, storage_options: Mapping[str, Any] | None) -> tuple[dict[str, Any], set[str]]:
    """The step's input-state targets (nested) and the first part of each of its keys."""
    reader = open_checkpoint(Storage(url, storage_options))
    try:
        reader.focus({})  # dtypes and shapes only: no chunk record is needed (a version-3 reader reads no index)
        ours = tuple(f"{k}." for k in INPUT_KEYS)
        stored_values, entries = reader.values(), reader.tensors()
        values = {k: from_json_value(v) for k, v in stored_values.items() if k.startswith(ours)}
        tensors = {k: torch.empty(e.shape, dtype=e.dtype) for k, e in entries.items() if k.startswith(ours)}
    finally:
        reader.close()
    return nest({**values, **tensors}), {k.split(".", 1)[0] for k in (*stored_values, *entries)}


def check_input_state(step: int, inputs: Mapping[str, Any], data: ElasticSampler | None,
                      stateful: Mapping[str, Stateful] | None, *, rng: bool, restores: bool,
                      process_group: Any = None) -> None:
    """Refuse, on every rank and before any target is written, input state that cannot be restored as
    asked; say at INFO what the step holds that this load leaves alone."""
    problem = input_state_refusal(inputs, data, stateful, rng=rng, restores=restores)
    raise_any_failure(Dist(process_group).first_error, problem,
                      lambda rank, text: f"resuming step {step} failed on rank {rank}: {text}")
    say_inputs_left(step, inputs, data, stateful)


def input_state_refusal(inputs: Mapping[str, Any], data: ElasticSampler | None,
                        stateful: Mapping[str, Stateful] | None, *, rng: bool, restores: bool
                        ) -> DataStateError | None:
    """This rank's half of :func:`check_input_state`, no collective: why ``inputs`` cannot be restored as
    asked, or ``None`` -- for a caller that tells the other ranks in an exchange it makes anyway (the hot
    tier's vote)."""
    if not restores:
        return None
    try:
        check_data_state_dict(inputs, data, stateful, rng=rng)
    except DataStateError as exc:
        return exc
    return None


def say_inputs_left(step: int, inputs: Mapping[str, Any], data: ElasticSampler | None,
                    stateful: Mapping[str, Stateful] | None) -> None:
    """At INFO, what step ``step`` holds that this load leaves alone (a sampler position, stateful objects)."""
    saved = inputs.get("data", {})
    left = ([f"an ElasticSampler position ({_position(saved['sampler'])}; pass data=<the sampler> to continue "
             f"it)"] if data is None and "sampler" in saved else []) + \
           [f"state of {name!r} (pass stateful={{{name!r}: ...}})" for name in saved.get("objects", {})
            if name not in (stateful or {})]
    if left:
        log.info("step %d holds %s that this load does not restore", step, " and ".join(left))


def _position(sampler_state: Any) -> str:
    if isinstance(sampler_state, dict):
        return f"epoch {sampler_state.get('epoch')}, {sampler_state.get('batches')} global batches into it"
    return "unreadable"
