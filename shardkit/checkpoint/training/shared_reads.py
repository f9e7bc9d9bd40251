"""Bytes several ranks need are read from storage once: one of them reads and checks, the others receive.

Under HSDP every replica of a shard holds the same boxes, so every replica
would ask storage for the same bytes (R replicas: R times the checkpoint, and
twice that with the checking pass).  Here each read request is named by what
it reads -- key, stored chunk, global box -- and the ranks compare names: a
request one rank alone needs stays its own; a request several ranks need is
given to one of them, chosen to balance the bytes each rank reads.  That rank
reads and checks it like any other; after every rank has read its share (and
all agree nothing failed), the bytes travel to the others with point-to-point
sends over the process group, straight into their targets when those are
contiguous host memory (through a host copy for a GPU target).

Nothing here depends on meshes or placements: any layout where ranks need
the same stored bytes (HSDP, tensor-parallel replicas, a plain tensor every
rank loads) shares its reads.  The exchange runs in rounds of at most
``ROUND_BYTES`` of requests, the same rounds on every rank (they are cut from
the list every rank knows), so the staging of non-contiguous targets stays
bounded and no send waits on a receive of a later round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from shardkit.checkpoint.formats.base import ReadRequest
from shardkit.checkpoint.io.dist import Dist

__all__ = ["SharedReads", "share_reads", "exchange", "ROUND_BYTES"]

ROUND_BYTES = 256 << 20


@dataclass
class SharedReads:
    """This rank's part of a load: what it reads from storage, and the requests whose bytes it sends
    (read here) or receives (read elsewhere), each with its round and tag (the same on every rank)."""

    mine: list[ReadRequest]
    sends: list[tuple[int, int, ReadRequest, list[int]]] = field(default_factory=list)  # round, tag, req, to
    receives: list[tuple[int, int, ReadRequest, int]] = field(default_factory=list)  # round, tag, req, from
    shared: bool = False  # whether any rank of the group sends or receives anything

    @property
    def rounds(self) -> int:
        return 1 + max((r for r, *_ in self.sends + self.receives), default=-1)


def _name(r: ReadRequest) -> str:
    """What a request reads, the same on every rank: stored chunks never overlap, so the key and box name
    the bytes (a chunk's number need not be: a rank that read some index files numbers only their chunks)."""
    return f"{r.fqn}|{list(r.box[0])}|{list(r.box[1])}"


def share_reads(requests: Sequence[ReadRequest], dist: Dist) -> SharedReads:
    """Decide who reads what.  Collective over ``dist`` (every rank must call it, with ``[]`` after a
    local failure); without a process group, or on a backend other than gloo, every rank reads its own."""
    if not dist.active or not _gloo(dist):
        return SharedReads(list(requests))
    mine = {}
    for r in requests:
        mine.setdefault(_name(r), []).append(r)
    everyone = dist.all_gather_json([[name, rs[0].out.numel() * rs[0].out.element_size(), len(rs)]
                                     for name, rs in mine.items()])
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    repeated: set[str] = set()  # a name one rank needs twice is read by each of its holders (rare)
    for rank, items in enumerate(everyone):
        for name, nbytes, count in items:
            holders.setdefault(name, []).append(rank)
            sizes[name] = nbytes
            if count > 1:
                repeated.add(name)
    load = [0] * dist.group_size
    for name, ranks in holders.items():
        if len(ranks) == 1 or name in repeated:
            for rank in ranks:
                load[rank] += sizes[name]
    plan = SharedReads([])
    round_index, filled = 0, 0
    for tag, name in enumerate(sorted(n for n, ranks in holders.items() if len(ranks) > 1 and n not in repeated)):
        ranks = holders[name]
        reader = min(ranks, key=lambda rank: (load[rank], rank))
        load[reader] += sizes[name]
        if filled and filled + sizes[name] > ROUND_BYTES:
            round_index, filled = round_index + 1, 0
        filled += sizes[name]
        plan.shared = True
        if name not in mine:
            continue
        (request,) = mine.pop(name)
        if reader == dist.group_rank:
            plan.mine.append(request)
            plan.sends.append((round_index, tag, request, [rank for rank in ranks if rank != reader]))
        else:
            plan.receives.append((round_index, tag, request, reader))
    plan.mine.extend(r for rs in mine.values() for r in rs)
    return plan


def exchange(plan: SharedReads, dist: Dist) -> None:
    """Send the bytes this rank read to the ranks that need them too, and receive what others read.

    Call only after every rank's reads succeeded (the sender's targets hold
    checked bytes).  Collective in spirit: every rank of the group takes part
    in each round, even one with nothing to send or receive in it.
    """
    if not plan.shared:
        return
    import torch.distributed as tdist

    def global_rank(group_rank: int) -> int:
        return tdist.get_global_rank(dist.group, group_rank) if dist.group is not None else group_rank

    with torch.no_grad():
        for round_index in range(plan.rounds):
            ops, unstage = [], []
            for rnd, tag, request, to in plan.sends:
                if rnd == round_index:
                    buf = request.out if _sendable(request.out) else request.out.cpu().contiguous()
                    ops.extend(tdist.P2POp(tdist.isend, buf, global_rank(rank), dist.group, tag) for rank in to)
            for rnd, tag, request, src in plan.receives:
                if rnd == round_index:
                    buf = request.out if _sendable(request.out) else torch.empty(
                        request.out.shape, dtype=request.out.dtype)
                    ops.append(tdist.P2POp(tdist.irecv, buf, global_rank(src), dist.group, tag))
                    if buf is not request.out:
                        unstage.append((request.out, buf))
            for work in tdist.batch_isend_irecv(ops) if ops else ():
                work.wait()
            for out, buf in unstage:
                out.copy_(buf)


def _sendable(out: torch.Tensor) -> bool:
    """Whether gloo can send or receive ``out`` in place: contiguous host memory (else a host copy travels)."""
    return out.device.type == "cpu" and out.is_contiguous()


def _gloo(dist: Dist) -> bool:
    import torch.distributed as tdist

    return tdist.get_backend(dist.group) == "gloo"
