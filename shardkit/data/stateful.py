"""Objects with ``state_dict()``/``load_state_dict()`` saved **global** or **per rank**.

Why the user must say which: shardkit cannot tell whether an object's state
is the same on every rank (an LR scheduler, a sampler over a global
sequence) or belongs to its rank (a loader reading its own shard of files,
torchdata's ``StatefulDataLoader`` over a ``DistributedSampler``).  Guessing
wrong is silent: a per-rank state saved once loses the other ranks'
positions; a global one saved per rank cannot be told apart from a bug.

* ``scope="global"``: saved once; every rank at any world size loads it.
  Saving checks that all ranks hold the same state.
* ``scope="per_rank"``: every rank's state is saved.  At the same world size
  rank ``r`` loads old rank ``r``'s state.  At another world size there is no
  rule shardkit could know, so ``reshard(states_by_old_rank, rank,
  world_size)`` decides, and without one loading raises
  :class:`~shardkit.errors.PerRankStateError` naming the object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from shardkit.errors import ConfigurationError, DataStateError, PerRankStateError

__all__ = ["Stateful", "Scope", "Reshard", "select_state"]

Scope = Literal["global", "per_rank"]
Reshard = Callable[[list[Any], int, int], Any]
_SCOPES = ("global", "per_rank")


@dataclass(frozen=True)
class Stateful:
    """``obj`` (anything with ``state_dict()`` and ``load_state_dict()``) with how to save it.

    ``reshard(states_by_old_rank, rank, world_size) -> state`` is only for
    ``scope="per_rank"``: it receives every old rank's state (a list indexed
    by old rank) and returns the state new rank ``rank`` of ``world_size``
    loads.
    """

    obj: Any
    scope: Scope = "global"
    reshard: Reshard | None = None

    def __post_init__(self) -> None:
        if self.scope not in _SCOPES:
            raise ConfigurationError(f"Stateful scope must be 'global' or 'per_rank', got {self.scope!r}")
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(self.obj, method, None)):
                raise ConfigurationError(f"Stateful needs an object with {method}(); "
                                         f"{type(self.obj).__qualname__} has none")
        if self.reshard is not None and self.scope != "per_rank":
            raise ConfigurationError("Stateful: reshard= only applies to scope='per_rank' (a global state is the "
                                     "same at every world size)")
        if self.reshard is not None and not callable(self.reshard):
            raise ConfigurationError(f"Stateful: reshard must be callable, got {type(self.reshard).__name__}")


def select_state(name: str, states_by_old_rank: list[Any], *, scope: Scope, rank: int, world_size: int,
                 reshard: Reshard | None = None) -> Any:
    """The state new rank ``rank`` of ``world_size`` loads for the object called ``name``.

    ``states_by_old_rank`` holds what was saved, indexed by old rank; a global
    state is saved once, so its list has one entry (any extra entries are
    ignored).  ``scope`` is the scope the state was *saved* with.
    """
    if scope not in _SCOPES:
        raise DataStateError(f"{name}: saved scope {scope!r} is neither 'global' nor 'per_rank'")
    if not states_by_old_rank:
        raise DataStateError(f"{name}: the checkpoint holds no saved state for it")
    if not 0 <= rank < world_size:
        raise DataStateError(f"{name}: rank {rank} is outside world size {world_size}")
    if scope == "global":
        return states_by_old_rank[0]
    old_world = len(states_by_old_rank)
    if old_world == world_size:
        return states_by_old_rank[rank]
    if reshard is None:
        raise PerRankStateError(
            f"{name} was saved per rank by {old_world} ranks and this run has {world_size}; shardkit cannot know "
            f"how its per-rank state maps onto other ranks. Pass Stateful(obj, scope='per_rank', "
            f"reshard=fn) with fn(states_by_old_rank, rank, world_size) -> state, or resume on {old_world} ranks")
    return reshard(list(states_by_old_rank), rank, world_size)
