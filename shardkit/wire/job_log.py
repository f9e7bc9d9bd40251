"""What every rank would log alike is logged once per job: by the group's first rank.

Why: a conclusion every rank reaches alike -- a replica count the job cannot
keep, nothing to resume, a damaged step skipped, input state left unrestored
-- is logged by each rank, so a 512-rank job prints the same WARNING 512
times and buries what differs between ranks.  Such a call site logs through
:func:`log_once_per_job` instead: rank 0 of the group logs it (a process
without a process group is its own rank 0).  What only one rank sees (its own
file, its own device, its own listing) must keep logging on that rank: it
would be lost if only rank 0 spoke.

A record keeps its call site (``funcName``/``lineno`` are the caller's).
"""

from __future__ import annotations

import logging
from typing import Any

from shardkit.wire.collectives import rank_world

__all__ = ["log_once_per_job", "speaks_for_the_job", "warning_once_per_job"]


def speaks_for_the_job(process_group: Any = None) -> bool:
    """Whether this process logs for the whole job: rank 0 of ``process_group`` (the default group when
    ``None``), or any process without a process group.  A rank outside ``process_group`` never does."""
    return rank_world(process_group)[0] == 0


def log_once_per_job(logger: logging.Logger, level: int, msg: str, *args: Any, process_group: Any = None,
                     **kwargs: Any) -> bool:
    """``logger.log(level, msg, *args)`` on the rank that speaks for the job only (see
    :func:`speaks_for_the_job`); returns whether this rank logged.  Call it on every rank alike, for a
    message every rank would word alike."""
    if not speaks_for_the_job(process_group):
        return False
    logger.log(level, msg, *args, stacklevel=kwargs.pop("stacklevel", 1) + 1, **kwargs)
    return True


def warning_once_per_job(logger: logging.Logger, msg: str, *args: Any, process_group: Any = None,
                         **kwargs: Any) -> bool:
    """:func:`log_once_per_job` at WARNING: the form most call sites need."""
    return log_once_per_job(logger, logging.WARNING, msg, *args, process_group=process_group,
                            stacklevel=kwargs.pop("stacklevel", 1) + 1, **kwargs)
