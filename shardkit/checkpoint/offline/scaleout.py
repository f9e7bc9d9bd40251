"""Scale-out of ``reshard``/``convert --to shardkit`` across processes under torchrun.

One process is the default.  Under ``torchrun ... -m shardkit reshard ...``
(recognised by ``TORCHELASTIC_RUN_ID``, which torchrun sets, or asked for
explicitly with ``--distributed``) every process plans the same output
layout (the plan is deterministic), takes its share of the output files --
work units balanced by bytes, largest first to the least loaded process
(:func:`~shardkit.checkpoint.formats.native.resumable.assign_units`) -- and writes them,
journaling each file's records on DST.  After a barrier, process 0 collects
the journaled records and commits the manifest.  Only barriers travel over
torch.distributed (gloo); the records travel through DST itself, so nothing
is pickled and a rerun after a failure resumes exactly like a single process.

``WORLD_SIZE``/``RANK`` alone do not switch scale-out on: job environments
(SLURM, Kubernetes training operators) set them for the *training* job, and a
conversion run inside such a pod must not wait for peers that never come.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from shardkit.checkpoint.formats import handler_for
from shardkit.checkpoint.offline.convert import convert, reshard
from shardkit.errors import ConfigurationError
from shardkit.wire.collectives import any_failed

__all__ = ["run_reshard", "run_convert", "scaleout_rank", "launched_by_torchrun", "agree"]

_RENDEZVOUS_TIMEOUT = datetime.timedelta(hours=2)  # also bounds each barrier: one unit of work may be large


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (torch elastic sets ``TORCHELASTIC_RUN_ID``)."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def scaleout_rank(distributed: bool | None = None) -> tuple[int, int]:
    """(rank, number of processes) to split the work over; (0, 1) unless scale-out is on.

    ``distributed=None`` means "on under torchrun"; ``True`` requires the
    launcher's ``RANK``/``WORLD_SIZE``; ``False`` forces one process.
    """
    if distributed is None:
        distributed = launched_by_torchrun()
    if not distributed:
        return 0, 1
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise ConfigurationError("--distributed needs RANK and WORLD_SIZE (and MASTER_ADDR/MASTER_PORT) from a "
                                 "launcher such as torchrun; drop --distributed to convert in one process") from None
    if not 0 <= rank < world:
        raise ConfigurationError(f"RANK={rank} is outside WORLD_SIZE={world}; check the launcher's environment")
    return rank, world


def _init_group() -> bool:
    """Join (or reuse) the default gloo group; True when this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    try:
        dist.init_process_group("gloo", timeout=_RENDEZVOUS_TIMEOUT)
    except (ValueError, RuntimeError, TimeoutError, OSError) as exc:
        raise ConfigurationError(f"cannot join the other conversion processes ({' '.join(str(exc).split())}); "
                                 "start the command with torchrun, or without --distributed for one "
                                 "process") from None
    return True


def run_reshard(src: str, dst: str, *, distributed: bool | None = None, **kwargs: Any) -> Any:
    """``reshard`` in this process, or this process's share of it under torchrun (``None`` off process 0)."""
    rank, nprocs = scaleout_rank(distributed)
    if nprocs <= 1:
        return reshard(src, dst, **kwargs)
    import torch.distributed as dist

    created = _init_group()
    try:
        return reshard(src, dst, scaleout=(dist.get_rank(), dist.get_world_size(), agree), **kwargs)
    finally:
        if created:
            dist.destroy_process_group()


def agree(ok: bool = True) -> bool:
    """A barrier that also tells every process whether all of them succeeded, so one process's failure
    stops the others instead of leaving them waiting: the offline tools' form of
    :func:`shardkit.wire.collectives.any_failed` over the default group."""
    return not any_failed(not ok)


def run_convert(src: str, dst: str, *, to: str, distributed: bool | None = None, **kwargs: Any) -> Any:
    """``convert`` in this process; under torchrun, native output is split like ``reshard`` (one
    writer rank), other formats are written by process 0 alone (their files are not per-rank)."""
    rank, nprocs = scaleout_rank(distributed)
    if nprocs <= 1:
        return convert(src, dst, to=to, **kwargs)
    target = handler_for(to)
    if target.resumes():
        if kwargs.pop("config", None) is not None:
            raise ConfigurationError(f"--config applies to hf output only, not --to {target.name}")
        kwargs.pop("max_shard_size", None)
        kwargs["world_size"] = kwargs.pop("world_size", None) or 1
        return run_reshard(src, dst, distributed=distributed, **kwargs)
    return convert(src, dst, to=to, **kwargs) if rank == 0 else None
