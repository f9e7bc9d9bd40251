"""Timing across ranks, shared by ``benchmarks/checkpoint.py`` and ``benchmarks/hot_tier.py``: an op between
barriers, its seconds on the slowest rank and its peak RSS, and the rotating order of the systems in a round.
Without a process group (the 1-process load) a barrier does nothing and a rank's figure is the job's."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import checkpoint_targets as targets  # beside this file (the benchmarks put benchmarks/ on sys.path)
import torch
import torch.distributed as dist


class PeakRSS:
    """Peak resident set size above the value at start (``delta``), sampled every 5 ms."""

    def __init__(self) -> None:
        import psutil

        proc = psutil.Process()
        self._rss = lambda: proc.memory_info().rss
        self._stop = threading.Event()
        self.base = self.peak = self._rss()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.delta = self.peak - self.base


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def max_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn: Callable[[], Any], state_nbytes: int, *, sleep_s: float = 0.0, uncached: bool = False,
          rank: int = 0) -> dict[str, float]:
    """Run ``fn`` between barriers; seconds (slowest rank) and peak RSS above the start (largest rank).

    ``sleep_s``: seconds asleep first ("cold": the VM hands freed memory back); ``uncached``: rank 0 drops
    the page cache first (``"dropped"`` in the result says whether it could)."""
    dropped = targets.drop_page_cache() if uncached and rank == 0 else True
    time.sleep(sleep_s)
    barrier()
    with PeakRSS() as rss:
        start = time.perf_counter()
        fn()
        barrier()
        seconds = time.perf_counter() - start
    return {"s": max_over_ranks(seconds), "rss": max_over_ranks(rss.delta / state_nbytes),
            "dropped": max_over_ranks(float(not dropped)) == 0.0}


def rotated(systems: tuple[str, ...], rep: int) -> tuple[str, ...]:
    """The systems in the order of repetition ``rep`` (the first one moves on each time)."""
    return systems[rep % len(systems):] + systems[:rep % len(systems)]

