"""The manager's tiers: what :class:`~shardkit.checkpoint.training.manager.CheckpointManager` asks of the
durable root (:mod:`~shardkit.checkpoint.training.durable_tier`) and of the node-local hot tier
(:mod:`~shardkit.checkpoint.training.hot.tier`), and what it hands them.

A save asks each tier in turn whether the step goes to it (``plan``, on every
rank, before the state is taken), has it ``stage`` the write (on the training
thread: the hot tier copies to host here for a background save, and hands the
tiers after it that host copy), runs the writes (here, or on the background
thread), and tells each tier once its write ``committed``.  A resume asks each
tier for the newest step it can load (``resume``), the hot tier first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import torch
import torch.nn as nn

from shardkit.data import ElasticSampler, Stateful

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Tier", "LoadTargets", "Resumed", "Staged"]

Write = Callable[["ProcessGroup | None"], None]  # the write of one step to a tier, on the given group


@dataclass(frozen=True)
class LoadTargets:
    """What a load fills and how: the model and optimizer in place, the input state, the load's options."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    strict: bool = True
    data: ElasticSampler | None = None
    stateful: Mapping[str, Stateful] | None = None
    rng: bool = True
    verify_first: bool = False
    from_dcp: str | None = None


@dataclass(frozen=True)
class Resumed:
    """The step a tier resumed from, its ``extra``, and which copy it came from (``"durable"`` or the hot
    tier's ``"own"``/``"replica"``/...)."""

    step: int
    extra: Any
    source: str


@dataclass(frozen=True)
class Staged:
    """A tier's write of one step, ready to run; ``state`` is what the tiers after it save (the hot tier's
    host copy in a background save, so the durable save shares it)."""

    write: Write
    state: Callable[[], dict[str, Any]]


class Tier(Protocol):
    """One place a manager keeps steps."""

    def plan(self, step: int, meta: dict[str, Any]) -> Any | None:
        """This tier's decision about ``step`` (``None``: the step does not go to this tier); collective."""

    def stage(self, plan: Any, state: dict[str, Any], *, background: bool) -> Staged:
        """The write of ``state`` as planned, prepared on the training thread."""

    def committed(self, plan: Any, pending: int | None) -> None:
        """After the write of ``plan`` succeeded (``pending``: a step still being written in the background)."""

    def resume(self, targets: LoadTargets, candidates: list[int]) -> Resumed | None:
        """Load the newest step this tier can give (above the durable ``candidates``' newest, for the hot
        tier) into ``targets``; ``None`` when it has none (collective)."""
