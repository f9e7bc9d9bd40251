"""The floors of the hot tier's recoveries, for ``benchmarks/hot_tier.py``: what no recovery can beat.

A floor does the raw work its recovery cannot avoid, and nothing else: no manifest, no checksum, no
agreement between the ranks.

* **Local** (``raw-local``): each rank reads the files of its own copy of the newest complete step in its
  node's directory (``<node dir>/run-*/step-*/rank-<r>.*/``, the bytes a recovery from the local tier reads),
  front to back into a buffer of the copy's size, allocated and touched once before the rounds.  Why not one
  small reused buffer (as the disk floor of ``checkpoint_targets`` reads): a recovery must land every byte in
  the state's own memory -- tens of MB of distinct pages per rank -- while a buffer of a few MB stays in the
  CPU's cache, so that floor skipped the writes to memory a recovery must make (about a fifth of the read's
  time at 75 MB on one core).  ``hot_tier.py`` still shows that figure (``raw-local-reused``) beside it.
* **Peer** (``raw-transfer``, judged: issue 40 defines this floor as "a raw gloo transfer of the same bytes
  between the same ranks"): the ranks of the lost node receive their state's bytes (``rank_bytes`` each)
  from the ranks that hold their replicas -- the same pairs a recovery from peers uses (rank ``r``'s replica
  is on rank ``r + local_world_size``, wrapping) -- as one gloo ``send``/``recv`` of a preallocated byte
  tensor per pair, all pairs at once.  ``hot_tier.py`` also shows ``raw-peer``: the same transfer while every
  rank that lost nothing reads its own copy as the local floor does (a recovery from peers restores those
  ranks too, on the same cores) -- everything the recovery does, raw; shown, not judged.
"""

from __future__ import annotations

import glob
import os
from typing import Callable

import checkpoint_targets as targets  # beside this file (hot_tier.py puts benchmarks/ on sys.path)
import torch
import torch.distributed as dist


def own_copy_files(node_dir: str, rank: int) -> list[str]:
    """The files of ``rank``'s own copy of the newest complete step under ``node_dir``."""
    steps = sorted(s for s in glob.glob(os.path.join(node_dir, "run-*", "step-*"))
                   if os.path.exists(os.path.join(s, "complete.json")))
    if not steps:
        raise SystemExit(f"no complete step under {node_dir}: the local floor would read nothing")
    copies = sorted(glob.glob(os.path.join(steps[-1], f"rank-{rank}.*")))
    if not copies:
        raise SystemExit(f"no copy of rank {rank} in {steps[-1]}")
    return sorted(os.path.join(d, f) for d, _, names in os.walk(copies[-1]) for f in names)


read_files_reused = targets.read_sequentially  # the disk floor's loop: one small reused buffer (shown, not judged)


def local_buffer(files: list[str]) -> torch.Tensor:
    """The buffer the local floor reads ``files`` into: their size in all, allocated and touched once, up front
    (as the state a recovery reads into exists, mapped, before it starts)."""
    return torch.ones(sum(os.path.getsize(f) for f in files), dtype=torch.uint8)


def read_files(files: list[str], into: torch.Tensor) -> int:
    """Read ``files`` one after the other, front to back, into ``into`` (back to back); the bytes read.  Nothing
    checked.  Raises ``SystemExit`` when they do not fit."""
    view, total = memoryview(into.numpy()).cast("B"), 0
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if total + size > len(view):
                raise SystemExit(f"the local floor's buffer ({len(view)} bytes) is too small for {files}")
            at = 0
            while at < size and (got := os.preadv(fd, [view[total + at:total + size]], at)):
                at += got
            total += at
        finally:
            os.close(fd)
    return total


def peer_buffer(nbytes: int) -> torch.Tensor:
    """The byte tensor one rank sends or receives in the peer floor (allocated and touched once, up front)."""
    return torch.ones(nbytes, dtype=torch.uint8)


def peer_transfer(buffer: torch.Tensor, lost_ranks: list[int], local_world_size: int,
                  meanwhile: Callable[[], object] | None = None) -> None:
    """Every rank of ``lost_ranks`` receives ``buffer``'s bytes from the rank holding its replica, all pairs at
    once; ``meanwhile()`` runs on every other rank while they travel (the peer floor: its own copy's read)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    holder = {r: (r + local_world_size) % world for r in lost_ranks}
    works = []
    if rank in holder:
        works.append(dist.irecv(buffer, src=holder[rank]))
    for target, source in holder.items():
        if source == rank:
            works.append(dist.isend(buffer, dst=target))
    if meanwhile is not None and rank not in holder:
        meanwhile()
    for work in works:
        work.wait()
