"""``CheckpointManager.load_latest``: the newest step any tier can give, loaded into the targets.

Rank 0 lists the durable root's resumable steps and tells the others (inside
the hot tier's exchange of reports, with ``local=``: one collective for both);
the hot tier is asked first for a step at or above the newest of them that
every rank can assemble from verified copies; else the durable tier
loads the newest intact step, falling back to older ones
(:mod:`~shardkit.checkpoint.training.step_fallback`).  Nothing to resume is
silent on a fresh root, a warning naming what was found otherwise, and
:class:`~shardkit.errors.CheckpointNotFound` with ``required=True`` -- unless a
hot copy found damaged had written targets already and no durable step loads
whole: then :class:`~shardkit.errors.CorruptCheckpoint`, never "nothing".
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
from shardkit.errors import CheckpointNotFound, CorruptCheckpoint
from shardkit.wire.job_log import warning_once_per_job

__all__ = ["resume_latest"]

log = logging.getLogger(__name__)


def resume_latest(durable: DurableTier, hot: HotTier | None, targets: LoadTargets,
                  required: bool) -> tuple[tuple[int, Any] | None, LastLoad | None]:
    """``((step, extra), how it was loaded)``, or ``(None, None)`` when there is nothing to resume."""
    started = time.perf_counter()

    def listing() -> list[int]:  # run on rank 0
        return durable.resumable_steps(dcp=targets.from_dcp is not None)

    touched = False
    if hot is not None:  # rank 0's listing rides in the hot tier's exchange of reports
        found, candidates, touched = hot.resume_listing(targets, listing, durable.root.url)
        if found is not None:
            durable.run.resumed = max((s for s in candidates if s <= found.step), default=None)
            return (found.step, found.extra), LastLoad(found.step, found.source, time.perf_counter() - started)
        log.info("resuming from the durable root %s (the hot tier has no newer step every rank can assemble)",
                 durable.root.url)
    else:
        candidates = durable.on_rank0(listing)
    if not candidates:
        if touched:
            _half_written(durable, "the durable root holds no committed step")
        _nothing(durable, durable.on_rank0(lambda: why_nothing(durable.root, durable.step_dirs())), required)
        return None, None
    found = durable.resume(targets, candidates)
    if found is None:
        every = f"every committed step ({', '.join(map(str, candidates))}) is damaged"
        if touched:
            _half_written(durable, every)
        _nothing(durable, f"{every}, and this manager will not save over them without overwrite=True", required)
        return None, None
    durable.run.resumed = found.step
    return (found.step, found.extra), LastLoad(found.step, found.source, time.perf_counter() - started)


def _half_written(durable: DurableTier, why: str) -> None:
    """A hot copy found damaged after it had written targets, and no durable step to load whole instead:
    the model is neither as it was nor any step, which no caller may take for "nothing to resume"."""
    raise CorruptCheckpoint(f"resuming under {durable.root.url}: a hot-tier copy was found damaged after it had "
                            f"written part of the model and optimizer state, no other hot step is whole, and "
                            f"{why}: the model is neither as it was nor any saved step")


def _nothing(durable: DurableTier, why: str | None, required: bool) -> None:
    if required:
        raise CheckpointNotFound(f"nothing to resume under {durable.root.url}: "
                                 f"{why or 'no committed step-<N> directory'}")
    if why:
        warning_once_per_job(log, "nothing to resume under %s: %s; starting from scratch", durable.root.url, why,
                             process_group=durable.options.process_group)
