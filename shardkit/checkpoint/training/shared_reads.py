"""Bytes several ranks need are read from storage once: one of them reads and checks, the others receive.

Under HSDP every replica of a shard holds the same boxes, so every replica
would ask storage for the same bytes (R replicas: R times the checkpoint, and
twice that with the checking pass).  Here each read request is named by what
it reads -- key, stored chunk, global box -- and the ranks compare names: a
request one rank alone needs stays its own; a request several ranks need is
given to one of them, chosen to balance the bytes each rank reads.  That rank
reads and checks it like any other; after every rank has read its share (and
all agree nothing failed), the bytes travel to the others with point-to-point
sends over the process group.

Nothing here depends on meshes or placements: any layout where ranks need
the same stored bytes (HSDP, tensor-parallel replicas, a plain tensor every
rank loads) shares its reads.  The exchange runs in rounds of at most
``round_bytes``, the same rounds on every rank (every rank cuts them from the
list of shared names, sizes and shapes that all of them know), so no send
waits on a receive of a later round and the memory a round stages is
bounded.  A request bigger than a round is cut into blocks of whole rows
(or, for rows bigger than a round, parts of a row), the same blocks on the
sending and the receiving rank.

How the bytes travel depends on the wire.  On gloo a block that is
contiguous host memory is sent and received in place; anything else (a
strided view, a GPU target) goes through the one
:class:`~shardkit.checkpoint.io.transfer_buffer.TransferBuffer` of the call.
NCCL sends device memory only, so there every block goes through that
buffer on the group's device: the reader's target (pinned host twin, then
the device buffer; or device to device for a GPU target), NCCL send/recv,
the receiver's device buffer, then its target (host through the pinned
twin, or device to device).  :func:`exchange`'s ``wire`` argument forces
that staging on gloo too, with the buffer on the CPU -- the same rounds and
slots, testable without a GPU.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from shardkit.checkpoint.formats.base import ReadRequest
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.transfer_buffer import ALIGNMENT, TransferBuffer
from shardkit.errors import ConfigurationError

__all__ = ["Piece", "SharedReads", "share_reads", "exchange", "ROUND_BYTES"]

ROUND_BYTES = 256 << 20

log = logging.getLogger(__name__)


@dataclass
class Piece:
    """One block of a shared request that travels in one round: ``request.out[index]``, sent to ``peers``
    (on the rank that reads it) or received from ``peers[0]`` (on a rank that needs it too).  Its
    round, tag and index are the same on both ends."""

    round: int
    tag: int
    request: ReadRequest
    index: tuple[Any, ...]
    peers: list[int]

    @property
    def view(self) -> torch.Tensor:
        return self.request.out[self.index]


@dataclass
class SharedReads:
    """This rank's part of a load: what it reads from storage, and the pieces it sends (read here) or
    receives (read elsewhere)."""

    mine: list[ReadRequest]
    sends: list[Piece] = field(default_factory=list)
    receives: list[Piece] = field(default_factory=list)
    shared: bool = False  # whether any rank of the group sends or receives anything

    @property
    def rounds(self) -> int:
        return 1 + max((p.round for p in self.sends + self.receives), default=-1)

    @property
    def for_others(self) -> list[ReadRequest]:
        """The requests this rank reads for other ranks too, each once."""
        seen: dict[int, ReadRequest] = {}
        for piece in self.sends:
            seen.setdefault(id(piece.request), piece.request)
        return list(seen.values())


def _name(r: ReadRequest) -> str:
    """What a request reads, the same on every rank: stored chunks never overlap, so the key and box name
    the bytes (a chunk's number need not be: a rank that read some index files numbers only their chunks)."""
    return f"{r.fqn}|{list(r.box[0])}|{list(r.box[1])}"


def share_reads(requests: Sequence[ReadRequest], dist: Dist, round_bytes: int = ROUND_BYTES) -> SharedReads:
    """Decide who reads what, and in which round each shared block travels.  Collective over ``dist``
    (every rank must call it, with ``[]`` after a local failure, and with the same ``round_bytes``);
    without a process group every rank reads its own."""
    if not isinstance(round_bytes, int) or isinstance(round_bytes, bool) or round_bytes < ALIGNMENT:
        raise ConfigurationError(f"round_bytes must be at least {ALIGNMENT} bytes (one element of any dtype), "
                                 f"got {round_bytes!r}")
    if not dist.active:
        return SharedReads(list(requests))
    mine: dict[str, list[ReadRequest]] = {}
    for r in requests:
        mine.setdefault(_name(r), []).append(r)
    everyone = dist.all_gather_json([[name, _nbytes(rs[0].out), len(rs), list(rs[0].out.shape)]
                                     for name, rs in mine.items()])
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    repeated: set[str] = set()  # a name one rank needs twice is read by each of its holders (rare)
    for rank, items in enumerate(everyone):
        for name, nbytes, count, shape in items:
            holders.setdefault(name, []).append(rank)
            sizes[name], shapes[name] = nbytes, shape
            if count > 1 or nbytes == 0:
                repeated.add(name)
    load = [0] * dist.group_size
    for name, ranks in holders.items():
        if len(ranks) == 1 or name in repeated:
            for rank in ranks:
                load[rank] += sizes[name]
    limit = round_bytes - round_bytes % ALIGNMENT
    plan = SharedReads([])
    round_index, filled, tag = 0, 0, 0
    for name in sorted(n for n, ranks in holders.items() if len(ranks) > 1 and n not in repeated):
        ranks = holders[name]
        reader = min(ranks, key=lambda rank: (load[rank], rank))
        load[reader] += sizes[name]
        plan.shared = True
        request = mine.pop(name)[0] if name in mine else None
        if request is not None and reader == dist.group_rank:
            plan.mine.append(request)
        itemsize = sizes[name] // math.prod(shapes[name])
        for index, nbytes in block_indices(shapes[name], itemsize, limit):
            if filled and filled + _aligned(nbytes) > limit:
                round_index, filled = round_index + 1, 0
            filled += _aligned(nbytes)
            if request is not None and reader == dist.group_rank:
                plan.sends.append(Piece(round_index, tag, request, index, [r for r in ranks if r != reader]))
            elif request is not None:
                plan.receives.append(Piece(round_index, tag, request, index, [reader]))
            tag += 1
    plan.mine.extend(r for rs in mine.values() for r in rs)
    return plan


def block_indices(shape: Sequence[int], itemsize: int, limit: int) -> list[tuple[tuple[Any, ...], int]]:
    """``(index, nbytes)`` of the blocks that cut a tensor of ``shape`` into parts of at most ``limit``
    bytes (``limit >= itemsize``): the whole tensor when it fits, else runs of whole rows, else each row
    cut the same way.  Pure arithmetic on the shape, so every rank derives the same blocks."""
    shape = list(shape)
    total = math.prod(shape) * itemsize
    if total <= limit or not shape:
        return [((), total)]
    row = math.prod(shape[1:]) * itemsize
    if row <= limit:
        per = limit // row
        return [((slice(a, min(a + per, shape[0])),), (min(a + per, shape[0]) - a) * row)
                for a in range(0, shape[0], per)]
    return [((i, *index), nbytes) for i in range(shape[0]) for index, nbytes in block_indices(shape[1:], itemsize, limit)]


def exchange(plan: SharedReads, dist: Dist, *, wire: torch.device | None = None) -> int:
    """Send the bytes this rank read to the ranks that need them too, and receive what others read;
    return the bytes of the staging buffer this rank held (at most the plan's ``round_bytes``).

    Call only after every rank's reads succeeded (the sender's targets hold
    checked bytes).  Collective in spirit: every rank of the group takes part
    in each round, even one with nothing to send or receive in it.  A copy
    into or out of the buffer that fails does not stop the rounds (the peers
    are committed to them); the failure is raised once they are over.

    ``wire``: the device the bytes travel from; ``None`` takes the group's
    (the CPU on gloo, with contiguous host blocks sent in place; the current
    CUDA device on NCCL).  Naming a device stages every block through the
    buffer on it.
    """
    if not plan.shared:
        return 0
    import torch.distributed as tdist

    in_place = wire is None and tdist.get_backend(dist.group) == "gloo"
    device = dist.device() if wire is None else wire
    slots, nbytes = _slots(plan, in_place)
    buffer = TransferBuffer(nbytes, device) if nbytes else None

    def global_rank(group_rank: int) -> int:
        return tdist.get_global_rank(dist.group, group_rank) if dist.group is not None else group_rank

    failure: BaseException | None = None
    with torch.no_grad():
        for round_index in range(plan.rounds):
            ops, landing = [], []
            for piece in (p for p in plan.sends if p.round == round_index):
                view, start = piece.view, slots.get(id(piece))
                if start is None:
                    sent = view
                else:
                    sent = buffer.receive_slice(start, view)
                    try:
                        sent = buffer.put(start, view)
                    except Exception as exc:  # noqa: BLE001 - the peers wait for this round: raised after it
                        failure = failure or exc
                ops.extend(tdist.P2POp(tdist.isend, sent, global_rank(rank), dist.group, piece.tag)
                           for rank in piece.peers)
            for piece in (p for p in plan.receives if p.round == round_index):
                view, start = piece.view, slots.get(id(piece))
                target = view if start is None else buffer.receive_slice(start, view)
                ops.append(tdist.P2POp(tdist.irecv, target, global_rank(piece.peers[0]), dist.group, piece.tag))
                if start is not None:
                    landing.append((start, view))
            for work in tdist.batch_isend_irecv(ops) if ops else ():
                work.wait()
            for start, view in landing:
                try:
                    buffer.take(start, view)
                except Exception as exc:  # noqa: BLE001 - later rounds still run: raised after them
                    failure = failure or exc
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    if failure is not None:
        raise failure
    log.debug("rank %d sent %d and received %d pieces in %d rounds through a %d-byte buffer on %s",
              dist.group_rank, len(plan.sends), len(plan.receives), plan.rounds, nbytes, device)
    return nbytes


def _slots(plan: SharedReads, in_place: bool) -> tuple[dict[int, int], int]:
    """Each staged piece's offset in the buffer (by ``id``), and the buffer's size: the most any round
    stages.  With ``in_place``, contiguous host blocks travel without a slot."""
    slots: dict[int, int] = {}
    used: dict[int, int] = {}
    for piece in plan.sends + plan.receives:
        view = piece.view
        if in_place and view.device.type == "cpu" and view.is_contiguous():
            continue
        slots[id(piece)] = used.get(piece.round, 0)
        used[piece.round] = slots[id(piece)] + _aligned(_nbytes(view))
    return slots, max(used.values(), default=0)


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
