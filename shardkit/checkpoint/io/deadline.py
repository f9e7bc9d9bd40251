"""The deadline of a checkpoint's collectives, and the words a rank that misses one earns the others.

Every collective a save, a load, a commit or the hot tier runs goes through
:class:`~shardkit.checkpoint.io.dist.Dist`, which first checks in at the job's
store (:mod:`shardkit.wire.arrival`) and gives up after the deadline named
here.  Why one deadline per operation and not the process group's timeout:
that one is 30 minutes by default and, under NCCL, is only as good as its
watchdog; a frozen peer must release the others in seconds, named.

The default, 600 s, is how long one rank may lag another at a phase's end
(torch_checkpointing's barrier default): the write phase of a large model at
scale can take minutes, and a rank that writes more than the others (the
lowest ranks write replicated tensors) must not be taken for a dead one.
``SHARDKIT_CHECKPOINT_TIMEOUT`` (seconds) changes it job-wide; ``timeout=`` on
``save``/``async_save``/``load``/``CheckpointManager`` per call.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Iterator

from shardkit.errors import CheckpointTimeout, ConfigurationError, PeerLost

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "Deadline", "resolve_timeout", "current_deadline",
           "checkpoint_deadline", "deadline_for", "with_step", "default_timeout", "timeout_error", "peer_lost_error"]

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "SHARDKIT_CHECKPOINT_TIMEOUT"

_AFTERMATH = {
    "save": "nothing was committed; every earlier step is still loadable",
    "load": "the state dict may be partly loaded: relaunch and load again",
}


def _seconds(value: Any, name: str) -> float:
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and name == TIMEOUT_ENV:
        try:
            seconds = float(value)
        except ValueError:
            raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}") from None
    else:
        raise ConfigurationError(f"{name} must be seconds (a number) or a datetime.timedelta, got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return seconds


def resolve_timeout(timeout: float | timedelta | None, name: str = "timeout") -> float | None:
    """``timeout`` in seconds, validated (``None`` stays ``None``: the enclosing operation's or the default)."""
    return None if timeout is None else _seconds(timeout, name)


def default_timeout() -> float:
    """``SHARDKIT_CHECKPOINT_TIMEOUT`` when set, else :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT_ENV)
    return DEFAULT_TIMEOUT_S if raw in (None, "") else _seconds(raw, TIMEOUT_ENV)


@dataclass(frozen=True)
class Deadline:
    """What a checkpoint's collectives are part of, for the deadline and the words of its error:
    ``operation`` (``save``, ``load``), the ``url``, the training ``step`` when known, and ``timeout_s``,
    how long a rank waits at one collective for the others."""

    operation: str = "checkpoint"
    url: str = ""
    step: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def describe(self) -> str:
        step = f" of step {self.step}" if self.step is not None else ""
        where = f" {'from' if self.operation == 'load' else 'to'} {self.url}" if self.url else ""
        return f"{self.operation}{step}{where}"

    def aftermath(self) -> str:
        return _AFTERMATH.get(self.operation.split()[-1], "")


_current: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("shardkit_checkpoint_deadline",
                                                                           default=None)


def current_deadline() -> Deadline:
    """The deadline of the checkpoint operation this thread runs (a default one outside any)."""
    found = _current.get()
    return found if found is not None else Deadline(timeout_s=default_timeout())


def deadline_for(operation: str, url: str = "", timeout: float | timedelta | None = None,
                 step: int | None = None) -> Deadline:
    """The deadline of ``operation`` of ``step`` at ``url``: ``timeout`` (validated), else the enclosing
    operation's (a ``CheckpointManager``'s), else the default; the step of the enclosing one when not given."""
    outer = _current.get()
    seconds = resolve_timeout(timeout)
    if seconds is None:
        seconds = outer.timeout_s if outer is not None else default_timeout()
    if outer is not None and step is None:
        step = outer.step
    return Deadline(operation, url or (outer.url if outer is not None else ""), step, seconds)


@contextlib.contextmanager
def checkpoint_deadline(operation: str, url: str = "", step: int | None = None,
                        timeout: float | timedelta | None = None) -> Iterator[Deadline]:
    """Run the block as ``operation`` of ``step`` at ``url`` (:func:`deadline_for`): every ``Dist`` made
    inside it, by this thread, takes this deadline."""
    deadline = deadline_for(operation, url, timeout, step)
    token = _current.set(deadline)
    try:
        yield deadline
    finally:
        _current.reset(token)


def with_step(deadline: Deadline, meta: Any) -> Deadline:
    """``deadline`` naming the step ``meta`` records (``{"step": 12}``) when it names none yet."""
    step = meta.get("step") if isinstance(meta, dict) else None
    return replace(deadline, step=step) if deadline.step is None and isinstance(step, int) else deadline


def _ranks(ranks: tuple[int, ...]) -> str:
    if not ranks:
        return "a rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def timeout_error(deadline: Deadline, phase: str, missing: tuple[int, ...]) -> CheckpointTimeout:
    """The error of a collective that ranks ``missing`` did not reach within the deadline."""
    doing = "writing" if phase in ("write", "commit") else "reading" if phase == "read" else "working"
    tail = deadline.aftermath()
    if tail and phase == "commit" and 0 in missing:  # rank 0 commits: it may have done so before it stopped
        tail = "the step is committed only if rank 0 wrote its manifest before it stopped (shardkit verify " \
               "tells); every earlier step is still loadable"
    return CheckpointTimeout(
        f"{deadline.describe()}: {_ranks(missing)} did not arrive at {phase!r} within {deadline.timeout_s:g} s "
        f"(dead, frozen, never called, or still {doing}){'; ' + tail if tail else ''}. "
        f"The process group cannot be used again: relaunch the job (it resumes from the newest committed step); "
        f"if ranks are merely slow, raise timeout= or {TIMEOUT_ENV}")


def peer_lost_error(deadline: Deadline, phase: str, missing: tuple[int, ...], cause: BaseException) -> PeerLost:
    """The error of a collective a rank left after arriving (it died: its connection reset)."""
    who = _ranks(missing)
    tail = deadline.aftermath()
    return PeerLost(
        f"{deadline.describe()}: {who} left the collective at {phase!r} (died, or its connection reset): "
        f"{str(cause).splitlines()[0] if str(cause) else type(cause).__name__}{'; ' + tail if tail else ''}. "
        f"The process group cannot be used again: relaunch the job (it resumes from the newest committed step)")
