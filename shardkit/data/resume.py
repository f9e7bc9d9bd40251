"""Data position, stateful objects and RNG in and out of a checkpoint, in one call each.

The checkpoint side stores what :func:`data_state_dict` returns next to the
model and optimizer: a nested dict of plain JSON values and CPU tensors,
which it flattens into keys like::

    data.sampler.epoch                     int     the ElasticSampler's global position
    data.sampler.batches                   int
    data.objects.<name>.scope              "global" | "per_rank"
    data.objects.<name>.state.json         str     a global object's state (see encode.py)
    data.objects.<name>.state.tensors.<i>  tensor
    data.objects.<name>.world_size         int     per_rank only
    data.objects.<name>.rank<r>.json       str     per_rank: one per saving rank
    rng.world_size                         int
    rng.rank<r>.python.state               [625 ints]   (see rng.py for every field)
    rng.rank<r>.torch                      uint8 tensor

Every part of every key is free of dots and no dict in it is empty, so
:func:`nest` rebuilds the dict exactly from the flat keys.  Every rank
returns the same dict (per-rank parts are all-gathered), so the checkpoint
can treat all of it as replicated: tensors written once, values from rank 0.

On resume the checkpoint reads every key under ``data.`` and ``rng.`` -- the
saved world size decides which exist, so it cannot pre-build targets --
passes ``nest(...)`` to :func:`load_data_state_dict`, and that restores the
sampler, the objects, and finally the RNGs (last, so nothing in between
draws from them).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Mapping

import torch

from shardkit.data.encode import decode_state, encode_state, encode_tree
from shardkit.data.gather import all_gather_trees
from shardkit.data.rng import capture_rng_state, check_rng_state, restore_rng_state
from shardkit.data.sampler import ElasticSampler
from shardkit.data.stateful import Stateful, select_state
from shardkit.errors import ConfigurationError, DataStateError
from shardkit.wire.collectives import rank_world
from shardkit.wire.job_log import warning_once_per_job
from shardkit.wire.rng_keys import RNG_ROOT, WORLD_SIZE, rank_key

__all__ = ["data_state_dict", "InputSnapshot", "load_data_state_dict", "check_data_state_dict", "nest"]

log = logging.getLogger("shardkit.data")

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def _checked_objects(objects: Mapping[str, Stateful] | None) -> dict[str, Stateful]:
    checked: dict[str, Stateful] = {}
    for name, wrapped in (objects or {}).items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigurationError(f"input-state object name {name!r} must be letters, digits, '_' or '-' (it "
                                     f"becomes part of the checkpoint key data.objects.<name>)")
        if not isinstance(wrapped, Stateful):
            raise ConfigurationError(
                f"input-state object {name!r} ({type(wrapped).__qualname__}) must say how it is saved: pass "
                f"Stateful(obj, scope='global') when every rank holds the same state, or "
                f"Stateful(obj, scope='per_rank') when each rank holds its own")
        checked[name] = wrapped
    return checked


def _describe(name: str, wrapped: Stateful) -> str:
    return f"input-state object {name!r} ({type(wrapped.obj).__qualname__})"


def _fingerprint(value: Any, where: str) -> tuple[str, list[tuple[str, tuple[int, ...], torch.Tensor]]]:
    tree, tensors = encode_tree(value, where)
    return (json.dumps(tree, allow_nan=False, sort_keys=True),
            [(str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8)) for t in tensors])


def _agreed(what: str, per_rank: list[Any]) -> Any:
    """The one state all ranks hold, or :class:`DataStateError` naming the first rank that differs."""
    text0, tensors0 = _fingerprint(per_rank[0], what)
    for rank in range(1, len(per_rank)):
        text, tensors = _fingerprint(per_rank[rank], what)
        same = text == text0 and len(tensors) == len(tensors0) and all(
            a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in zip(tensors, tensors0))
        if not same:
            raise DataStateError(
                f"{what} is saved as global but rank {rank} holds a different state than rank 0; if each rank "
                f"really holds its own, save it with scope='per_rank'")
    return per_rank[0]


def data_state_dict(sampler: ElasticSampler | None = None, objects: Mapping[str, Stateful] | None = None, *,
                    rng: bool = True, group: Any = None) -> dict[str, Any]:
    """Snapshot the data position, ``objects`` and every rank's RNG as ``{"data": ..., "rng": ...}``.

    Collective over ``group`` (default: all ranks) when a process group
    exists: call it on every rank, on the training thread, at the step being
    saved.  The result is the same on every rank and holds copies, so an
    asynchronous save may keep it while training goes on.  ``"data"`` is left
    out when there is neither sampler nor object, ``"rng"`` with
    ``rng=False``.  Raises :class:`DataStateError` when ranks disagree about a
    global state (the sampler's position or a ``scope="global"`` object).
    """
    return InputSnapshot(sampler, objects, rng=rng).gathered(group)


class InputSnapshot:
    """This rank's input state taken now, and every rank's once :meth:`gathered` -- what
    :func:`data_state_dict` returns, in two halves.

    Why two: the gather is a collective (tens of ms at a few ranks on a busy
    node), while only the taking must happen at the step.  A save that runs
    in the background (the hot tier's) takes the snapshot on the training
    thread and gathers it in its background part.  ``called`` names the call
    in the error of ranks that took it with other arguments."""

    def __init__(self, sampler: ElasticSampler | None = None, objects: Mapping[str, Stateful] | None = None, *,
                 rng: bool = True, called: str = "data_state_dict") -> None:
        self.wrapped = _checked_objects(objects)
        self.has_sampler = sampler is not None
        self.rng = rng
        self.called = called
        self.local = {
            "sampler": sampler.state_dict() if sampler is not None else None,
            "objects": {name: w.obj.state_dict() for name, w in self.wrapped.items()},
            "rng": capture_rng_state() if rng else None,
        }

    def gathered(self, group: Any = None) -> dict[str, Any]:
        """Every rank's input state, as :func:`data_state_dict` returns it (collective over ``group``: every
        rank of it calls)."""
        wrapped = self.wrapped
        gathered = all_gather_trees(self.local, "input state", group)
        world = len(gathered)
        for rank, g in enumerate(gathered):
            if (g["sampler"] is None) == self.has_sampler or sorted(g["objects"]) != sorted(wrapped) or \
                    (g["rng"] is None) == self.rng:
                raise DataStateError(
                    f"{self.called} was called with other arguments on rank {rank} than on this rank: every rank "
                    f"must pass a sampler or none, the same object names ({sorted(wrapped)} here, "
                    f"{sorted(g['objects'])} there) and the same rng flag")
        data: dict[str, Any] = {}
        if self.has_sampler:
            data["sampler"] = _agreed("the ElasticSampler position", [g["sampler"] for g in gathered])
        saved_objects: dict[str, Any] = {}
        for name, w in wrapped.items():
            where = f"data.objects.{name}"
            states = [g["objects"][name] for g in gathered]
            if w.scope == "global":
                state = _agreed(_describe(name, w), states)
                saved_objects[name] = {"scope": "global", "state": encode_state(state, where)}
            else:
                per_rank = {rank_key(r): encode_state(s, f"{where}.{rank_key(r)}") for r, s in enumerate(states)}
                saved_objects[name] = {"scope": "per_rank", WORLD_SIZE: world, **per_rank}
        if saved_objects:
            data["objects"] = saved_objects
        out: dict[str, Any] = {"data": data} if data else {}
        if self.rng:
            out[RNG_ROOT] = {WORLD_SIZE: world, **{rank_key(r): g["rng"] for r, g in enumerate(gathered)}}
        return out


def _world_entries(entry: Any, where: str) -> list[Any]:
    if not isinstance(entry, dict) or not isinstance(entry.get(WORLD_SIZE), int) or entry[WORLD_SIZE] < 1:
        raise DataStateError(f"{where}: expected world_size and rank<r> entries, got {entry!r:.200}")
    missing = [rank_key(r) for r in range(entry[WORLD_SIZE]) if rank_key(r) not in entry]
    if missing:
        raise DataStateError(f"{where}: saved by {entry[WORLD_SIZE]} ranks but {', '.join(missing)} are missing")
    return [entry[rank_key(r)] for r in range(entry[WORLD_SIZE])]


def check_data_state_dict(state: Mapping[str, Any], sampler: ElasticSampler | None = None,
                          objects: Mapping[str, Stateful] | None = None, *, rng: bool = True,
                          rank: int | None = None, world_size: int | None = None) -> None:
    """Raise every refusal :func:`load_data_state_dict` would raise for these arguments, restoring nothing.

    A resume checks this before it writes any model or optimizer tensor, so
    a sampler built for another sequence, an object the checkpoint lacks or
    per-rank state that cannot map onto this world size leaves the whole run
    as it was.  Only the structure is checked: tensor values may still be
    unread placeholders, and a ``reshard`` function is not called.
    """
    _decide(state, sampler, objects, rng=rng, rank=rank, world_size=world_size, run_reshard=False)


def load_data_state_dict(state: Mapping[str, Any], sampler: ElasticSampler | None = None,
                         objects: Mapping[str, Stateful] | None = None, *, rng: bool = True,
                         rank: int | None = None, world_size: int | None = None) -> None:
    """Restore what :func:`data_state_dict` saved, at this or another world size.

    ``state`` is the nested dict (``nest`` of the checkpoint's ``data.*`` and
    ``rng.*`` keys).  Not collective: each rank restores from the copy it
    holds.  ``rank``/``world_size`` default to the default process group's
    (or 0 and 1 without one).  The sampler continues with exactly the next
    global batch at any world size; objects load their state by the scope
    they were saved with (:func:`shardkit.data.select_state`); RNGs are
    restored last, exactly at the same world size and by the documented
    re-seed rule otherwise.  Anything asked for that the checkpoint lacks
    raises :class:`DataStateError` naming it, before anything is restored.
    """
    wrapped, chosen, rng_states, rank, world_size = _decide(
        state, sampler, objects, rng=rng, rank=rank, world_size=world_size, run_reshard=True)
    data = state.get("data", {})
    if sampler is not None:
        sampler.load_state_dict(dict(data["sampler"]))
    for name, w in wrapped.items():
        w.obj.load_state_dict(chosen[name])
    unused = sorted(set(data.get("objects", {})) - set(wrapped))
    if unused:
        warning_once_per_job(log, "the checkpoint holds input state for %s that this load did not restore",
                             ", ".join(unused))
    if rng_states is not None:
        restore_rng_state(rng_states, rank, world_size)


def _decide(state: Mapping[str, Any], sampler: ElasticSampler | None, objects: Mapping[str, Stateful] | None, *,
            rng: bool, rank: int | None, world_size: int | None, run_reshard: bool) -> tuple:
    """Every state a load restores, decided (and every refusal raised) before anything is touched."""
    if rank is None or world_size is None:
        default_rank, default_world = rank_world()
        rank = default_rank if rank is None else rank
        world_size = default_world if world_size is None else world_size
    wrapped = _checked_objects(objects)
    data = state.get("data", {})
    if sampler is not None:
        if "sampler" not in data:
            raise DataStateError("the checkpoint holds no ElasticSampler position (data.sampler); it was saved "
                                 "without a sampler")
        sampler.check_state_dict(dict(data["sampler"]))
    saved_objects = data.get("objects", {})
    chosen = {name: _object_state(name, w, saved_objects, rank, world_size, run_reshard)
              for name, w in wrapped.items()}
    rng_states = None
    if rng:
        if RNG_ROOT not in state:
            raise DataStateError("the checkpoint holds no RNG state (rng.*); it was saved with rng=False -- pass "
                                 "rng=False to load without it")
        rng_states = _world_entries(state[RNG_ROOT], RNG_ROOT)
        check_rng_state(rng_states, rank, world_size)
    return wrapped, chosen, rng_states, rank, world_size


def _object_state(name: str, w: Stateful, saved_objects: Mapping[str, Any], rank: int, world_size: int,
                  run_reshard: bool = True) -> Any:
    what = _describe(name, w)
    if name not in saved_objects:
        raise DataStateError(f"the checkpoint holds no state for {what} (data.objects.{name}); saved objects: "
                             f"{sorted(saved_objects) or 'none'}")
    entry = saved_objects[name]
    scope = entry.get("scope") if isinstance(entry, dict) else None
    where = f"data.objects.{name}"
    if scope == "global":
        states = [decode_state(entry.get("state"), f"{where}.state")]
    elif scope == "per_rank":
        states = [decode_state(s, f"{where}.{rank_key(r)}") for r, s in enumerate(_world_entries(entry, where))]
    else:
        raise DataStateError(f"{where}: saved scope {scope!r} is neither 'global' nor 'per_rank'")
    if scope != w.scope:
        log.info("%s was saved with scope %r and is declared %r now; loading by the saved scope", what, scope, w.scope)
    if not run_reshard and w.reshard is not None:
        return None  # the structure is sound; the user's function runs when the state is really loaded
    return select_state(what, states, scope=scope, rank=rank, world_size=world_size, reshard=w.reshard)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Flat checkpoint keys (``"data.sampler.epoch"``) back into the nested dict they came from."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise DataStateError(f"checkpoint key {key!r} nests under a value, not a dict")
        if leaf in node:
            raise DataStateError(f"checkpoint key {key!r} is given twice or also holds nested keys")
        node[leaf] = value
    return out
