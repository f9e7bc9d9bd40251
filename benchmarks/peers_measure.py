"""Timing and checking on the ranks of ``benchmarks/peers.py``'s jobs (its docstring says what is measured and
why): joining the job on its device, an op between barriers timed on the slowest rank, the page-cache drop
before a cold load, the exact per-tensor sums every load is checked by, and the raw floor's write and its read
straight into the tensors."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import checkpoint_targets as targets  # beside this file (peers.py puts benchmarks/ on sys.path)
import peers_systems as ps
import torch
import torch.distributed as dist

DEVICE = "cpu"  # the workers' device: set by join() from --device


def join(args: argparse.Namespace) -> None:
    """Join the job: gloo on the CPU, or NCCL with this rank's GPU (``LOCAL_RANK``) for ``--device cuda``."""
    global DEVICE
    torch.set_num_threads(1)
    DEVICE = args.device
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")


def sync_device() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def evict(paths: list[str], rank: int) -> str:
    """Drop the page cache (rank 0) before a cold load; how: ``drop_caches`` or ``fadvise`` on ``paths``."""
    how = ""
    if rank == 0:
        how = "drop_caches" if targets.drop_page_cache() else "fadvise"
        for path in paths if how == "fadvise" else []:
            for name in [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] or [path]:
                fd = os.open(name, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
    dist.barrier()
    return how


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    sync_device()
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    sync_device()
    seconds = time.perf_counter() - start
    dist.barrier()
    return max_over_ranks(seconds), result


def rank_sums(state: dict[str, Any]) -> dict[str, tuple[int | None, float]]:
    """Per tensor: (rows this rank holds, or None for a plain tensor; the float64 sum of its local values)."""
    return {k: (ps.local(t).shape[0] if hasattr(t, "to_local") and t.dim() else None,
                float(ps.local(t).double().sum())) for k, t in ps.tensors(state).items()}


def zero(state: dict[str, Any]) -> None:
    for t in ps.tensors(state).values():
        ps.local(t).zero_()


def check_full(state: dict[str, Any], per_rank: list[dict[str, list]], system: str) -> None:
    """The full tensors after a resharding load hold, rank by rank, the rows each rank saved (exact sums)."""
    for key, t in ps.tensors(state).items():
        offset = 0
        for sums in per_rank:
            rows, total = sums[key]
            part = t if rows is None else t[offset:offset + rows]
            if float(part.double().sum()) != total:
                raise SystemExit(f"{system}: the resharding load gives other values for {key}")
            if rows is None:
                break
            offset += rows


def raw_read_into(state: dict[str, Any], path: str) -> None:
    """Read ``path`` (what :func:`raw_write` wrote) straight into ``state``'s local tensors, on as many threads
    as shardkit's load reads with (``DEFAULT_IO_THREADS``), each a consecutive run of the tensors through one
    descriptor front to back -- the read shardkit's load does, without its checksums."""
    from concurrent.futures import ThreadPoolExecutor

    from shardkit.checkpoint.io.concurrency import DEFAULT_IO_THREADS

    items, pos = [], 0
    for t in ps.tensors(state).values():
        target = ps.local(t)
        items.append((pos, target))
        pos += target.numel() * target.element_size()
    lanes = max(1, min(DEFAULT_IO_THREADS, len(items)))
    runs: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(lanes)]
    for offset, target in items:  # consecutive runs of about equal bytes
        runs[min(lanes - 1, offset * lanes // max(pos, 1))].append((offset, target))

    def read(run: list[tuple[int, torch.Tensor]]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, target in run:
                flat = target.reshape(-1) if target.is_contiguous() else torch.empty(target.numel(),
                                                                                      dtype=target.dtype)
                view = memoryview(flat.view(torch.uint8).numpy())
                done = 0
                while done < len(view):
                    got = os.preadv(fd, [view[done:]], offset + done)
                    if not got:
                        raise SystemExit(f"{path} ends before the state's bytes do")
                    done += got
                if flat.data_ptr() != target.data_ptr():
                    target.copy_(flat.view(target.shape))
        finally:
            os.close(fd)

    with ThreadPoolExecutor(lanes) as pool:
        list(pool.map(read, runs))


def raw_write(state: dict[str, Any], path: str) -> None:
    with open(path, "wb") as f:
        for t in ps.tensors(state).values():
            f.write(ps.local(t).contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
        f.flush()
        os.fsync(f.fileno())
