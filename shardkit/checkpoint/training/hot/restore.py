"""Resuming a manager's model, optimizer and input state from the hot tier, and the record of how.

:func:`resume_hot` runs :func:`~.recover.recover` with a checker that builds this rank's targets (the
training state plus the input state the copy holds) from a copy whose every byte was checked, and asks
whether the input state can be restored as asked -- the ranks learn each other's answers in the exchange
that agrees on the step, so a refusal raises on every rank (as a durable resume's does: it is not damage)
without a collective of its own.  Then each rank writes its targets, restores the data position and
objects, and the RNG last; one last agreement tells every rank whether all of them did.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn as nn

from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.state.training_state import get_training_state, set_training_state
from shardkit.checkpoint.state.tree import flatten
from shardkit.checkpoint.training.hot.copies import CheckedCopy, check_copy, input_targets, structure_of
from shardkit.checkpoint.training.hot.flat import FlatCopy
from shardkit.checkpoint.training.hot.nodes import NodeLayout
from shardkit.checkpoint.training.hot.recover import recover
from shardkit.checkpoint.training.input_state import input_state_refusal, say_inputs_left
from shardkit.data import ElasticSampler, Stateful, load_data_state_dict
from shardkit.errors import DataStateError
from shardkit.wire.collectives import raise_any_failure

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["LastLoad", "resume_hot"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LastLoad:
    """How the manager's last ``load_latest`` resumed: ``step``, ``source`` (``"local"``: every rank read
    its own node's copy; ``"peer"``: some rank needed a replica from another node; ``"durable"``: the
    durable root) and the wall-clock ``seconds`` it took."""

    step: int
    source: str
    seconds: float


@dataclass
class _Opened:
    copy: CheckedCopy
    state: dict[str, Any]
    inputs: dict[str, Any]
    restores_inputs: bool


def resume_hot(layout: NodeLayout, group: ProcessGroup | None, model: nn.Module,
               optimizer: torch.optim.Optimizer | None, *,
               data: ElasticSampler | None, stateful: Mapping[str, Stateful] | None, rng: bool,
               at_least: int) -> tuple[int, Any, str] | None:
    """Load the newest hot step at or above ``at_least`` that every rank can assemble from verified copies;
    ``(step, extra, source)``, or ``None`` when there is none (collective)."""
    training = get_training_state(model, optimizer)  # the live tensors: taken and flattened once
    flat = flatten(training)
    structure = structure_of(flat.tensors)

    def open_copy(copy: FlatCopy) -> _Opened:
        inputs = input_targets(copy)  # filled from the copy already: not targets to check and write again
        restores = data is not None or bool(stateful) or (rng and "rng" in inputs)
        return _Opened(check_copy(copy, flat, structure), {**training, **inputs}, inputs, restores)

    def refusal(opened: _Opened) -> DataStateError | None:
        """Input state that cannot be restored as asked (checked with the copy: the ranks learn it when they
        agree on the step, so it costs no exchange of its own)."""
        return input_state_refusal(opened.inputs, data, stateful, rng=rng and "rng" in opened.inputs,
                                   restores=opened.restores_inputs)

    found = recover(layout, structure, open_copy, lambda opened: opened.copy.discard(), at_least=at_least,
                    group=group, refusal=refusal)
    if found is None:
        return None
    opened = found.opened
    say_inputs_left(found.step, opened.inputs, data, stateful)
    problem = None
    try:
        opened.copy.apply()
        set_training_state(model, optimizer, {k: v for k, v in opened.state.items() if k in ("model", "optim")})
        if opened.restores_inputs:
            load_data_state_dict({k: opened.state[k] for k in opened.inputs}, data, stateful,
                                 rng=rng and "rng" in opened.state)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it below
        problem = exc
    resumed = Dist(group)
    resumed.phase = "read"
    raise_any_failure(resumed.first_error, problem,
                      lambda failed, text: f"resuming hot step {found.step} failed on rank {failed}: {text}")
    log.info("resumed from hot step %d (%s copy)", found.step, found.source)
    return found.step, found.meta.get("extra"), found.source
