"""``CheckpointManager.load_latest``: the newest step any tier can give, loaded into the targets.

Rank 0 lists the durable root's resumable steps and tells the others; the hot
tier (with ``local=``) is asked first for a step at or above the newest of
them that every rank can assemble from verified copies; else the durable tier
loads the newest intact step, falling back to older ones
(:mod:`~shardkit.checkpoint.training.step_fallback`).  Nothing to resume is
silent on a fresh root, a warning naming what was found otherwise, and
:class:`~shardkit.errors.CheckpointNotFound` with ``required=True``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from shardkit.checkpoint.training.durable_tier import DurableTier
from shardkit.checkpoint.training.hot.restore import LastLoad
from shardkit.checkpoint.training.hot.tier import HotTier
from shardkit.checkpoint.training.step_fallback import why_nothing
from shardkit.checkpoint.training.tiers import LoadTargets
from shardkit.errors import CheckpointNotFound
from shardkit.wire.job_log import warning_once_per_job

__all__ = ["resume_latest"]

log = logging.getLogger(__name__)


def resume_latest(durable: DurableTier, hot: HotTier | None, targets: LoadTargets,
                  required: bool) -> tuple[tuple[int, Any] | None, LastLoad | None]:
    """``((step, extra), how it was loaded)``, or ``(None, None)`` when there is nothing to resume."""
    started = time.perf_counter()
    candidates = durable.on_rank0(lambda: durable.resumable_steps(dcp=targets.from_dcp is not None))
    if hot is not None:
        found = hot.resume(targets, candidates)
        if found is not None:
            durable.run.resumed = max((s for s in candidates if s <= found.step), default=None)
            return (found.step, found.extra), LastLoad(found.step, found.source, time.perf_counter() - started)
        log.info("resuming from the durable root %s (the hot tier has no newer step every rank can assemble)",
                 durable.root.url)
    if not candidates:
        _nothing(durable, durable.on_rank0(lambda: why_nothing(durable.root, durable.step_dirs())), required)
        return None, None
    found = durable.resume(targets, candidates)
    if found is None:
        every = f"every committed step ({', '.join(map(str, candidates))}) is damaged"
        _nothing(durable, f"{every}, and this manager will not save over them without overwrite=True", required)
        return None, None
    durable.run.resumed = found.step
    return (found.step, found.extra), LastLoad(found.step, found.source, time.perf_counter() - started)


def _nothing(durable: DurableTier, why: str | None, required: bool) -> None:
    if required:
        raise CheckpointNotFound(f"nothing to resume under {durable.root.url}: "
                                 f"{why or 'no committed step-<N> directory'}")
    if why:
        warning_once_per_job(log, "nothing to resume under %s: %s; starting from scratch", durable.root.url, why,
                             process_group=durable.options.process_group)
