"""The retry policy every storage operation follows: backoff, the one WARNING per URL, and Ctrl-C.

Why here and not in each backend: a save of a thousand files retries through one rule -- waits that
double from :data:`BACKOFF_BASE_S` to :data:`BACKOFF_CAP_S` with jitter (ranks throttled together do not
retry together, and no wait holds an interrupt longer than the cap), one WARNING the first time a URL is
retried in a process (the other attempts at DEBUG), and one switch that stops every retrying thread at once
(a signal reaches only the main thread).  :meth:`~shardkit.checkpoint.io.storage.Storage.retry` is the loop;
this module is what it asks.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from typing import Any, Mapping

from shardkit.checkpoint.io.clouds import OWN_KEY
from shardkit.errors import ConfigurationError

__all__ = ["BACKOFF_BASE_S", "BACKOFF_CAP_S", "allow_retries", "backoff_delay", "first_retry_of", "interrupt_retries",
           "retries_interrupted", "wait_unless_interrupted", "with_retries"]

BACKOFF_BASE_S = 0.25  # the nominal wait before the first retry; doubled for each further one
BACKOFF_CAP_S = 2.0    # no wait between two attempts is longer
_WARNED_MAX = 4096     # URLs remembered as warned about (the oldest are forgotten first)

_warned: OrderedDict[str, None] = OrderedDict()
_warned_lock = threading.Lock()
_interrupted = threading.Event()


def interrupt_retries() -> None:
    """Stop every retry loop of this process at once: a wait in progress ends, and each operation
    that would retry raises its last error instead.  For an interrupt handler (Ctrl-C) whose worker
    threads are retrying: a signal reaches only the main thread.  :func:`allow_retries` undoes it."""
    _interrupted.set()


def allow_retries() -> None:
    """Retry again after :func:`interrupt_retries`."""
    _interrupted.clear()


def backoff_delay(attempt: int) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based): exponential, capped, jittered.

    The nominal wait doubles from :data:`BACKOFF_BASE_S` up to :data:`BACKOFF_CAP_S`; the wait is drawn
    uniformly from its upper half, so that ranks throttled together do not retry together, while no
    wait exceeds the cap (an interrupt or a deadline is never held longer than that by a backoff).
    """
    nominal = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** min(attempt - 1, 16))
    return nominal * random.uniform(0.5, 1.0)


def with_retries(storage_options: Mapping[str, Any] | None, retries: int | None) -> dict[str, Any] | None:
    """``storage_options`` with shardkit's ``retries`` set: what a top-level ``retries=`` argument means.

    ``None`` leaves the options as they are; a different ``retries`` already inside them is a
    :class:`~shardkit.errors.ConfigurationError` (two answers to one question).  The value is checked
    where every option is, when the :class:`~shardkit.checkpoint.io.storage.Storage` is made."""
    if retries is None:
        return None if storage_options is None else dict(storage_options)
    options = dict(storage_options or {})
    own = options.get(OWN_KEY) or {}
    if not isinstance(own, Mapping):
        raise ConfigurationError(f"storage option {OWN_KEY!r} must be an object like {{'retries': 3}}, got {own!r}")
    if own.get("retries", retries) != retries:
        raise ConfigurationError(f"retries={retries!r} and storage option {OWN_KEY}.retries={own['retries']!r} "
                                 "disagree; give one of them")
    options[OWN_KEY] = {**own, "retries": retries}
    return options


def first_retry_of(url: str) -> bool:
    """Whether ``url`` is retried for the first time in this process (then it is remembered)."""
    with _warned_lock:
        if url in _warned:
            _warned.move_to_end(url)
            return False
        _warned[url] = None
        if len(_warned) > _WARNED_MAX:
            _warned.popitem(last=False)
        return True


def retries_interrupted() -> bool:
    """Whether :func:`interrupt_retries` was called (and not undone by :func:`allow_retries`)."""
    return _interrupted.is_set()


def wait_unless_interrupted(seconds: float) -> bool:
    """Wait ``seconds`` before a retry; ``True`` when :func:`interrupt_retries` ended the wait first."""
    return _interrupted.wait(seconds)
