"""The floors of the hot tier's recoveries, for ``benchmarks/hot_tier.py``: what no recovery can beat.

* **Local**: each rank reads the files of its own copy of the newest complete step in its node's directory
  (``<node dir>/run-*/step-*/rank-<r>.*/``, the bytes a recovery from the local tier reads), front to back
  into one reused buffer, nothing checked or copied.
* **Peer**: the ranks of the lost node receive their state's bytes (``rank_bytes`` each) from the ranks
  that hold their replicas -- the same pairs a recovery from peers uses (rank ``r``'s replica is on rank
  ``r + local_world_size``, wrapping) -- as one gloo ``send``/``recv`` of a preallocated byte tensor per
  pair, all pairs at once; nothing read from or written to disk.
"""

from __future__ import annotations

import glob
import os

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


read_files = targets.read_sequentially  # the local floor reads as the disk's floor does, the same loop


def peer_buffer(nbytes: int) -> torch.Tensor:
    """The byte tensor one rank sends or receives in the peer floor (allocated and touched once, up front)."""
    return torch.ones(nbytes, dtype=torch.uint8)


def peer_transfer(buffer: torch.Tensor, lost_ranks: list[int], local_world_size: int) -> None:
    """Every rank of ``lost_ranks`` receives ``buffer``'s bytes from the rank holding its replica."""
    rank, world = dist.get_rank(), dist.get_world_size()
    holder = {r: (r + local_world_size) % world for r in lost_ranks}
    if rank in holder:
        dist.recv(buffer, src=holder[rank])
    for target, source in holder.items():
        if source == rank:
            dist.send(buffer, dst=target)
