"""Resuming a manager's model, optimizer and input state from the hot tier, and the record of how.

:func:`resume_hot` runs :func:`~.recover.recover` with a checker that builds this rank's targets (the
training state plus the input state the copy holds) from a copy -- read whole and checked, or (its own, on
its node) with only the input state read so far -- and asks whether the input state can be restored as
asked: the ranks learn each other's answers in the exchange that agrees on the step, so a refusal raises on
every rank (as a durable resume's does: it is not damage) before any target is written, without a
collective of its own.  Then each rank writes its targets (reading its own copy straight into them), restores
the data position and objects, and the RNG last; one agreement tells every rank whether all of them did.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.nn as nn

from shardkit.checkpoint.state.training_state import get_training_state, set_training_state
from shardkit.checkpoint.state.tree import flatten
from shardkit.checkpoint.training.hot.copies import CheckedCopy, check_copy, input_targets, structure_of
from shardkit.checkpoint.training.hot.fetch import PeerFetch
from shardkit.checkpoint.training.hot.flat import FlatCopy, PendingCopy
from shardkit.checkpoint.training.hot.nodes import NodeLayout
from shardkit.checkpoint.training.hot.recover import Steps, recover
from shardkit.checkpoint.training.input_state import input_state_refusal, say_inputs_left
from shardkit.data import ElasticSampler, Stateful, load_data_state_dict
from shardkit.errors import DataStateError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["LastLoad", "HotResume", "resume_hot"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LastLoad:
    """How the manager's last ``load_latest`` resumed: ``step``, ``source`` (``"local"``: every rank read
    its own node's copy; ``"peer"``: some rank needed a replica from another node; ``"durable"``: the
    durable root) and the wall-clock ``seconds`` it took."""

    step: int
    source: str
    seconds: float


@dataclass(frozen=True)
class HotResume:
    """What :func:`resume_hot` did: ``found`` (``(step, extra, source)``, or ``None``: no hot step every rank
    can assemble), rank 0's ``listing()`` on every rank, and ``touched``: a copy found damaged while it was
    read into the targets left them written in part (every rank agrees) -- a caller that then loads no
    other step whole must raise, never report nothing to resume."""

    found: tuple[int, Any, str] | None
    listed: Any
    touched: bool


@dataclass
class _Opened:
    copy: CheckedCopy
    state: dict[str, Any]
    inputs: dict[str, Any]
    restores_inputs: bool


def resume_hot(layout: NodeLayout, group: ProcessGroup | None, model: nn.Module,
               optimizer: torch.optim.Optimizer | None, *,
               data: ElasticSampler | None, stateful: Mapping[str, Stateful] | None, rng: bool,
               at_least: int = 0, listing: Callable[[], list[int]] | None = None,
               where: str = "") -> HotResume:
    """Load the newest hot step at or above ``at_least`` (or the newest step rank 0's ``listing()`` gives)
    that every rank can assemble from verified copies (collective); see :class:`HotResume`."""
    training = get_training_state(model, optimizer)  # the live tensors: taken and flattened once
    flat = flatten(training)
    structure = structure_of(flat.tensors)

    def open_copy(copy: FlatCopy | PendingCopy) -> _Opened:
        inputs = input_targets(copy)  # filled from the copy already: not targets to check and write again
        restores = data is not None or bool(stateful) or (rng and "rng" in inputs)
        return _Opened(check_copy(copy, flat, structure), {**training, **inputs}, inputs, restores)

    def refusal(opened: _Opened) -> DataStateError | None:
        """Input state that cannot be restored as asked (checked with the copy: the ranks learn it when they
        agree on the step, so it costs no exchange of its own)."""
        return input_state_refusal(opened.inputs, data, stateful, rng=rng and "rng" in opened.inputs,
                                   restores=opened.restores_inputs)

    def apply(opened: _Opened) -> None:
        say_inputs_left(step_of(opened), opened.inputs, data, stateful)
        opened.copy.apply()
        set_training_state(model, optimizer, {k: v for k, v in opened.state.items() if k in ("model", "optim")})
        if opened.restores_inputs:
            load_data_state_dict({k: opened.state[k] for k in opened.inputs}, data, stateful,
                                 rng=rng and "rng" in opened.state)

    def receive(opened: _Opened, fetch: PeerFetch) -> None:
        """The fetch's data round (every rank); a peer's copy lands in the targets and its input state's own
        tensors, checked as it lands (its problem raised by the copy's fill); a rank with its own copy reads
        it into its targets while its sends travel (a damaged byte raised by the fill that follows)."""
        pending = opened.copy.copy
        peer = isinstance(pending, PendingCopy) and pending.remote

        def fill_own() -> None:
            with contextlib.suppress(Exception):  # kept by the copy, raised again by the fill that follows
                opened.copy.fill()

        problem = fetch.data({**opened.copy.targets, **pending.tensors} if peer else None,
                             meanwhile=None if peer else fill_own)
        if peer:
            pending.problem = problem

    def step_of(opened: _Opened) -> int:
        return int(opened.copy.meta["hot"]["step"])

    recovery = recover(layout, structure, open_copy,
                       Steps(fill=lambda opened: opened.copy.fill(), apply=apply,
                             discard=lambda opened: opened.copy.discard(),
                             receive=receive),
                       at_least=at_least, group=group, refusal=refusal, listing=listing, where=where)
    found = recovery.found
    if found is None:
        return HotResume(None, recovery.listed, recovery.touched)
    log.info("resumed from hot step %d (%s copy)", found.step, found.source)
    return HotResume((found.step, found.meta.get("extra"), found.source), recovery.listed, recovery.touched)
