"""The input state a checkpoint step holds (``data.*`` and ``rng.*``: shardkit.data), read and checked
before a resume writes any model or optimizer tensor, so a refusal leaves the run as it was."""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from shardkit.checkpoint.formats import open_reader
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.state.tree import from_json_value
from shardkit.data import ElasticSampler, Stateful, check_data_state_dict, nest
from shardkit.errors import DataStateError, error_record, from_record

__all__ = ["INPUT_KEYS", "stored_input_state", "check_input_state"]

INPUT_KEYS = ("data", "rng")  # top-level keys of resumable input state (shardkit.data), beside model and optim

log = logging.getLogger("shardkit.checkpoint.training.input_state")


def stored_input_state(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Load targets for the ``data.*`` and ``rng.*`` keys a checkpoint holds, nested.

    Which keys exist depends on the world size that saved (one RNG state per
    rank), so the targets are built from the checkpoint itself: an empty
    tensor of the stored dtype and shape per tensor key, the stored value per
    value key (``load`` fills both in place).
    """
    reader = open_reader(url, storage_options)
    try:
        reader.focus({})  # dtypes and shapes only: no chunk record is needed (a version-3 reader reads no index)
        ours = tuple(f"{k}." for k in INPUT_KEYS)
        values = {k: from_json_value(v) for k, v in reader.values().items() if k.startswith(ours)}
        tensors = {k: torch.empty(e.shape, dtype=e.dtype) for k, e in reader.tensors().items() if k.startswith(ours)}
    finally:
        reader.close()
    return nest({**values, **tensors})


def check_input_state(step: int, inputs: Mapping[str, Any], data: ElasticSampler | None,
                      stateful: Mapping[str, Stateful] | None, *, rng: bool, restores: bool,
                      process_group: Any = None) -> None:
    """Refuse, on every rank and before any target is written, input state that cannot be restored as
    asked; say at INFO what the step holds that this load leaves alone."""
    problem = None
    if restores:
        try:
            check_data_state_dict(inputs, data, stateful, rng=rng)
        except DataStateError as exc:
            problem = exc
    failed = Dist(process_group).first_error(None if problem is None else error_record(problem))
    if failed is not None:
        if problem is not None:
            raise problem
        raise from_record(failed[1], f"resuming step {step} failed on rank {failed[0]}: {failed[1]['message']}")
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
