"""Arrival with a deadline before a collective: every rank of a group checks in at the job's store first.

Why not rely on the collective's own timeout: a rank that died, was frozen
by the scheduler (``SIGSTOP``) or never called holds every other rank inside
the collective until the process group's timeout (30 minutes by default,
gloo's raw "Timed out" then) or, under NCCL without a watchdog, forever.  The
store (the TCPStore every process group is formed through, hosted by the
launcher's agent under torchrun) answers on gloo and NCCL alike, so ranks
agree there first, within a deadline of their own, and enter the collective
only once everyone is present.  A rank that misses it is named from its own
key: the others raise instead of waiting.

The keys, under ``shardkit/arrive/<group name>/``: a counter per collective
(``<seq>/n``, added to by each rank), a done flag set by the rank that
completes it (``<seq>/done``), and one key per rank holding the last
sequence it reached (``at/<rank>``, overwritten, so the store stays O(world)).
Every rank advances the group's sequence identically because it calls the
same collectives in the same order (as the collectives themselves require);
a collective's counter and flag are spent once every rank arrived at the next
one (no rank can still be waiting on them), and the group's rank 0 deletes
them while it waits inside that next collective (:func:`complete`), where the
store's round trips overlap the collective instead of delaying its start.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

__all__ = ["Arrival", "arrive", "delete_spent", "roll_call", "group_name", "the_group", "watched", "complete",
           "report_failure"]

# Waiters poll (store.wait's timeouts log a C++ warning every time, and hold off Ctrl-C), backing off from
# half a millisecond by a quarter each time: a poll oversleeps the moment the others arrived by at most a
# quarter of what the rank had waited (doubling let it oversleep by as much again: 60 ms became up to
# 127 ms, on every save and load), and a thousand waiting ranks ask the store at most ten times a second each
# once the wait is long.
_POLL_FIRST_S = 0.0005
_POLL_GROWTH = 1.25
_POLL_MAX_S = 0.1
# a waiter asks whether the collective before failed on another rank only once it has waited this long: a
# fast arrival does not pay for the question, and a failure is noticed long before the deadline
_FAILED_BEFORE_AFTER_S = 0.01
_WORK_POLL_MAX_S = 0.01  # a collective's own completion is polled locally, its failure flag at the store pace
# by process group object, held weakly: a group formed again under the same name starts anew, and a group the
# program let go of is not kept alive into the interpreter's finalization (shardkit.held_groups says why)
_sequences: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
# the keys of collectives every rank has left behind, deleted by the group's rank 0 while it waits inside the
# next collective (:func:`complete`) rather than before entering it: each deletion is a round trip to the
# store, which with more ranks than cores took as long as the collective itself, and every other rank waited
# in the collective for rank 0 to come through them
_spent: list[str] = []
_SPENT_AT_MOST = 64  # past this many (collectives waited for without complete), deleted at the next arrival


@dataclass(frozen=True)
class Arrival:
    """Who reached a collective in time.  ``missing``: the global ranks that did not arrive (empty when all
    did); ``behind``: for each of them, the sequence number it last reached (-1 for none) against ``seq``."""

    seq: int
    missing: tuple[int, ...]
    behind: tuple[int, ...]
    # what a rank reported of the collective before (``seq - 1``) while this one waited: it failed there,
    # though it completed here -- a gather's senders finish before the receiving rank sees a sender die
    failed_before: str | None = None


def the_group(group: Any) -> Any:
    """``group``, or the default group's object for ``None``."""
    import torch.distributed as dist

    return group if group is not None else dist.group.WORLD


def group_name(group: Any) -> str:
    """``group``'s name (the default group's when ``None``): the same on every rank, unique per group."""
    return the_group(group).group_name


def _store() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def arrive(group: Any, timeout_s: float) -> Arrival:
    """Check this rank in at ``group``'s next collective and wait up to ``timeout_s`` for the others.

    Returns at once when every rank of ``group`` has arrived (``missing`` empty), else after ``timeout_s``
    naming those that did not.  Errors of the store itself (its host is gone) propagate as torch raises them.
    """
    import torch.distributed as dist

    name, pg = group_name(group), the_group(group)
    with _lock:
        seq = _sequences.get(pg, 0)
        _sequences[pg] = seq + 1
    store, size, me = _store(), dist.get_world_size(group), dist.get_rank(group)
    base = f"shardkit/arrive/{name}/"
    store.set(f"{base}at/{me}", str(seq))
    done = f"{base}{seq}/done"
    if store.add(f"{base}{seq}/n", 1) == size:
        store.set(done, "1")
    else:
        started = time.monotonic()
        deadline, pause = started + timeout_s, _POLL_FIRST_S
        failed_before = f"{base}{seq - 1}/failed" if seq > 0 else None
        while not store.check([done]):
            now = time.monotonic()
            if now - started > _FAILED_BEFORE_AFTER_S and failed_before and store.check([failed_before]):
                return Arrival(seq, (), (), store.get(failed_before).decode())
            left = deadline - now
            if left <= 0:
                return _who_is_missing(store, base, group, size, seq)
            time.sleep(min(pause, left))
            pause = min(pause * _POLL_GROWTH, _POLL_MAX_S)
    if me == 0 and seq > 0:  # every rank has left collective seq - 1 behind: its keys are spent
        _spent.extend((f"{base}{seq - 1}/n", f"{base}{seq - 1}/done"))
        if len(_spent) > _SPENT_AT_MOST:
            delete_spent(store)
    return Arrival(seq, (), ())


def delete_spent(store: Any = None) -> None:
    """Delete the spent keys :func:`arrive` left (see ``_spent``); safe from any thread, each key once."""
    store = store if store is not None else _store()
    while _spent:
        try:
            key = _spent.pop()
        except IndexError:  # another thread took the last one
            return
        store.delete_key(key)


def _who_is_missing(store: Any, base: str, group: Any, size: int, seq: int) -> Arrival:
    import torch.distributed as dist

    if store.check([f"{base}{seq}/done"]):  # the last rank arrived just now
        return Arrival(seq, (), ())
    keys = [f"{base}at/{r}" for r in range(size)]
    present = [store.check([k]) for k in keys]
    reached = [int(store.get(k)) if ok else -1 for k, ok in zip(keys, present)]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    late = [(ranks[r], at) for r, at in enumerate(reached) if at < seq]
    return Arrival(seq, tuple(r for r, _ in late), tuple(at for _, at in late))


def roll_call(group: Any, seq: int, wait_s: float) -> tuple[int, ...]:
    """The global ranks of ``group`` that do not answer within ``wait_s`` after collective ``seq`` failed.

    Every survivor of a collective a rank left (it died: torch raised a connection error) calls it: each
    checks in under ``seq``'s roll-call counter and waits for the others, so that, where the survivors all
    saw the failure, each names the same dead ranks.
    """
    import torch.distributed as dist

    store, size, me = _store(), dist.get_world_size(group), dist.get_rank(group)
    base = f"shardkit/arrive/{group_name(group)}/{seq}/alive/"
    store.set(f"{base}{me}", "1")
    keys = [f"{base}{r}" for r in range(size)]
    deadline = time.monotonic() + wait_s
    while True:
        here = [store.check([k]) for k in keys]
        if all(here) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    return tuple(ranks[r] for r, ok in enumerate(here) if not ok)


_watch: contextvars.ContextVar[tuple[Any, int, float] | None] = contextvars.ContextVar("shardkit_collective_watch",
                                                                                     default=None)


@contextlib.contextmanager
def watched(group: Any, seq: int, timeout_s: float) -> Iterator[None]:
    """Collectives of the block (collective ``seq`` of ``group``) complete through :func:`complete`: released
    when another rank reports the collective failed (:func:`report_failure`), or after ``timeout_s``."""
    token = _watch.set((group, seq, time.monotonic() + timeout_s))
    try:
        yield
    finally:
        _watch.reset(token)


def complete(work: Any, pollable: bool = True) -> None:
    """Wait for ``work`` (an async collective's handle).  Inside :func:`watched`, by polling it, so that a rank
    blocked on a live peer that has given up -- not on the dead rank itself -- is released too, and a peer
    frozen inside the collective does not hold it past the deadline; both raise ``RuntimeError``.

    ``pollable=False`` for point-to-point work: gloo completes a send or a receive only inside ``wait``, so
    it is waited for with the deadline's remaining time instead (released at the deadline, not before).
    """
    found = _watch.get()
    if found is None:
        work.wait()
        return
    group, seq, deadline = found
    if _spent:  # the collective is under way: the store's round trips overlap it instead of delaying it
        with contextlib.suppress(Exception):  # housekeeping; a store that is gone fails the next arrival
            delete_spent()
    if not pollable:
        work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        return
    store, key, pause = _store(), f"shardkit/arrive/{group_name(group)}/{seq}/failed", _POLL_FIRST_S
    # the store is first asked whether another rank failed once the wait is long: a collective that completes
    # fast pays no round trip for the question (with more ranks than cores each took as long as the collective)
    asked, ask_every = time.monotonic(), _FAILED_BEFORE_AFTER_S
    finished = _finished_event(work)
    while not work.is_completed():
        now = time.monotonic()
        if now - asked >= ask_every:
            if store.check([key]):
                raise RuntimeError(f"another rank's part of this collective failed: {store.get(key).decode()}")
            asked, ask_every = now, min(ask_every * _POLL_GROWTH, _POLL_MAX_S)
        if now >= deadline:
            raise RuntimeError("timed out inside the collective (a rank froze after arriving)")
        if finished is not None:  # woken the moment the work completes; the store is still asked on schedule
            if finished.wait(max(min(asked + ask_every, deadline) - now, 0.0)):
                # its future is done, so wait() returns at once; gloo's is_completed() can lag the future by
                # tens of ms, and looping on the set event until then holds the GIL the training thread needs
                break
        else:
            time.sleep(pause)
            pause = min(pause * _POLL_GROWTH, _WORK_POLL_MAX_S)
    work.wait()


def _finished_event(work: Any) -> threading.Event | None:
    """An event set when ``work`` completes (through its future's callback), so a waiter wakes at once
    rather than at its next poll -- which oversleeps a fast collective by up to a quarter of its time, on
    every collective of a save; ``None`` for a work that has no future (it is then polled)."""
    finished = threading.Event()
    try:
        work.get_future().add_done_callback(lambda _future: finished.set())
    except (AttributeError, RuntimeError):
        return None
    return finished


def report_failure(group: Any, seq: int, why: str) -> None:
    """Tell the other ranks in collective ``seq`` of ``group`` that it failed here (see :func:`complete`)."""
    _store().set(f"shardkit/arrive/{group_name(group)}/{seq}/failed", why)
