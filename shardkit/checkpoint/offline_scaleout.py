"""Scale-out of ``reshard``/``convert --to shardkit`` across processes under torchrun.

One process is the default.  Under ``torchrun ... -m shardkit reshard ...``
(``WORLD_SIZE`` > 1 in the environment) every process plans the same output
layout (the plan is deterministic), takes its share of the output files --
work units balanced by bytes, largest first to the least loaded process
(:func:`~shardkit.checkpoint.offline_native.assign_units`) -- and writes them,
journaling each file's records on DST.  After a barrier, process 0 collects
the journaled records and commits the manifest.  Only barriers travel over
torch.distributed (gloo); the records travel through DST itself, so nothing
is pickled and a rerun after a failure resumes exactly like a single process.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["run_reshard", "scaleout_rank", "agree"]


def scaleout_rank() -> tuple[int, int]:
    """(rank, number of processes) of a torchrun launch, or (0, 1) for a plain process."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def run_reshard(src: str, dst: str, **kwargs: Any) -> Any:
    """``reshard`` in this process, or this process's share of it under torchrun."""
    from shardkit.checkpoint.offline import reshard

    rank, nprocs = scaleout_rank()
    if nprocs <= 1:
        return reshard(src, dst, **kwargs)
    import datetime

    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
        created = True
    try:
        return reshard(src, dst, scaleout=(dist.get_rank(), dist.get_world_size(), agree), **kwargs)
    finally:
        if created:
            dist.destroy_process_group()


def agree(ok: bool = True) -> bool:
    """A barrier that also tells every process whether all of them succeeded (all-reduce of a flag),
    so one process's failure stops the others instead of leaving them waiting."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def run_convert(src: str, dst: str, *, to: str, **kwargs: Any) -> Any:
    """``convert`` in this process; under torchrun, native output is split like ``reshard`` (one
    writer rank), other formats are written by process 0 alone (their files are not per-rank)."""
    from shardkit.checkpoint.offline import convert, reshard

    rank, nprocs = scaleout_rank()
    if nprocs <= 1:
        return convert(src, dst, to=to, **kwargs)
    if to in ("shardkit", "native"):
        for key in ("max_shard_size", "src_format"):
            kwargs.pop(key, None)
        kwargs["world_size"] = kwargs.pop("world_size", None) or 1
        return run_reshard(src, dst, **kwargs)
    return convert(src, dst, to=to, **kwargs) if rank == 0 else None
