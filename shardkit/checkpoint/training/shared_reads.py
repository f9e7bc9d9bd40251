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

How the bytes travel.  Between a reader and the ranks that need the same
blocks, a round carries messages: a block of at least ``pack_below`` bytes
is a message of its own; the smaller blocks going to the same ranks are
packed into one message, so a model of many small tensors costs one send
per peer and round, not one per tensor.  Both ends cut the same messages
from the plan alone, in the same order, and each decides by itself how its
side travels: a message of one block whose target is contiguous on the
wire's device (the group's: the CPU on gloo, the current GPU on NCCL) is
sent or received in place, as bytes; anything else goes through a slot of
the one :class:`~shardkit.checkpoint.io.transfer_buffer.TransferBuffer` of
the call, which holds at most one round (on NCCL a host target crosses
through its page-locked twin).  The buffer is set up by
:func:`prepare_exchange` before the ranks agree to send, so a rank that
cannot hold it fails every rank at that agreement, not halfway into a round.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from shardkit.checkpoint.formats.base import ReadRequest
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.rounds import ALIGNMENT, ROUND_BYTES, aligned, nbytes_of
from shardkit.checkpoint.io.transfer_buffer import TransferBuffer
from shardkit.errors import ConfigurationError, error_record, from_record

__all__ = ["SharedBlock", "SharedReads", "Message", "PreparedExchange", "share_reads", "block_indices",
           "prepare_exchange", "exchange", "PACK_BELOW", "REREAD_BELOW"]

PACK_BELOW = 1 << 20  # bytes: smaller blocks share a message (a copy of 1 MiB costs about one send's latency)
# bytes: shared reads smaller than this in all are read by every rank that needs them where small reads are
# cheap -- an optimizer's step counts, the RNG states a manager's resume loads (about 10 KB per saving rank)
# of a few ranks (``load`` reads it at each call: a test sets it to 0 to send even a few bytes)
REREAD_BELOW = 64 << 10

log = logging.getLogger(__name__)


@dataclass
class SharedBlock:
    """One block of a request several ranks need, ``request.out[index]`` (``nbytes``): read by ``reader``,
    sent to ``receivers`` in ``round``.  Round, tag, size and ranks are the same on every rank."""

    round: int
    tag: int
    request: ReadRequest
    index: tuple[Any, ...]
    nbytes: int
    reader: int
    receivers: tuple[int, ...]

    @property
    def view(self) -> torch.Tensor:
        return self.request.out[self.index]


@dataclass
class SharedReads:
    """This rank's part of a load: what it reads from storage, and the blocks it sends (read here) or
    receives (read elsewhere)."""

    mine: list[ReadRequest]
    sends: list[SharedBlock] = field(default_factory=list)
    receives: list[SharedBlock] = field(default_factory=list)
    shared: bool = False  # whether any rank of the group sends or receives anything
    pack_below: int = PACK_BELOW
    failed: tuple[int, Any] | None = None  # (group rank, error record) of the lowest rank that reported one

    @property
    def rounds(self) -> int:
        return 1 + max((b.round for b in self.sends + self.receives), default=-1)

    @property
    def for_others(self) -> list[ReadRequest]:
        """The requests this rank reads for other ranks too, each once."""
        seen: dict[int, ReadRequest] = {}
        for block in self.sends:
            seen.setdefault(id(block.request), block.request)
        return list(seen.values())


def _name(r: ReadRequest) -> str:
    """What a request reads, the same on every rank: stored chunks never overlap, so the key and box name
    the bytes (a chunk's number need not be: a rank that read some index files numbers only their chunks)."""
    return f"{r.fqn}|{list(r.box[0])}|{list(r.box[1])}"


def share_reads(requests: Sequence[ReadRequest], dist: Dist, round_bytes: int = ROUND_BYTES,
                pack_below: int = PACK_BELOW, failure: Any = None, reread_below: int = 0) -> SharedReads:
    """Decide who reads what, and in which round each shared block travels.  Collective over ``dist``
    (every rank must call it, with ``[]`` after a local failure, and with the same ``round_bytes`` and
    ``pack_below``); without a process group every rank reads its own.

    ``failure``: this rank's error record (:func:`~shardkit.errors.error_record`) when it failed before
    this call, else ``None``.  It travels with the rank's names, so the ranks agree on whether any of
    them failed in the same collective: ``failed`` holds the lowest failing rank's ``(rank, record)``
    on every rank (and nothing is planned), where a separate agreement would cost a collective more.

    ``reread_below``: when every byte the ranks would share adds up to less than this (the smallest any
    rank passes), nothing is shared and each rank reads what it needs itself.  A load passes
    :data:`REREAD_BELOW` where small reads are cheap (a local disk): a few scalars every rank holds
    (an optimizer's step counts) then cost each rank a few more bytes from the page cache instead of an
    agreement and a round of transfers."""
    if not isinstance(round_bytes, int) or isinstance(round_bytes, bool) or round_bytes < ALIGNMENT:
        raise ConfigurationError(f"round_bytes must be at least {ALIGNMENT} bytes (one slot of the transfer "
                                 f"buffer), got {round_bytes!r}")
    if not dist.active:
        return SharedReads(list(requests), failed=None if failure is None else (dist.group_rank, failure))
    mine: dict[str, list[ReadRequest]] = {}
    for r in requests:
        mine.setdefault(_name(r), []).append(r)
    gathered = dist.all_gather_json({"failure": failure, "reread_below": reread_below, "reads": [
        [name, nbytes_of(rs[0].out), len(rs), list(rs[0].out.shape)] for name, rs in mine.items()]})
    failed = next(((rank, g["failure"]) for rank, g in enumerate(gathered) if g["failure"] is not None), None)
    if failed is not None:
        return SharedReads([], failed=failed)
    everyone = [g["reads"] for g in gathered]
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
    below = min(g["reread_below"] for g in gathered)
    if sum(sizes[n] for n, ranks in holders.items() if len(ranks) > 1 and n not in repeated) < below:
        repeated.update(holders)  # too few bytes to be worth a round of transfers: each rank reads its own
    load = [0] * dist.group_size
    for name, ranks in holders.items():
        if len(ranks) == 1 or name in repeated:
            for rank in ranks:
                load[rank] += sizes[name]
    limit = round_bytes - round_bytes % ALIGNMENT
    plan = SharedReads([], pack_below=pack_below)
    round_index, filled, tag = 0, 0, 0
    for name in sorted(n for n, ranks in holders.items() if len(ranks) > 1 and n not in repeated):
        ranks = holders[name]
        reader = min(ranks, key=lambda rank: (load[rank], rank))
        load[reader] += sizes[name]
        plan.shared = True
        request = mine.pop(name)[0] if name in mine else None
        if request is not None and reader == dist.group_rank:
            plan.mine.append(request)
        receivers = tuple(r for r in ranks if r != reader)
        itemsize = sizes[name] // math.prod(shapes[name])
        for index, nbytes in block_indices(shapes[name], itemsize, limit):
            if filled and filled + aligned(nbytes) > limit:
                round_index, filled = round_index + 1, 0
            filled += aligned(nbytes)
            if request is not None:
                block = SharedBlock(round_index, tag, request, index, nbytes, reader, receivers)
                (plan.sends if reader == dist.group_rank else plan.receives).append(block)
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
    return [((i, *index), nbytes) for i in range(shape[0])
            for index, nbytes in block_indices(shape[1:], itemsize, limit)]


@dataclass
class Message:
    """What one send carries from ``blocks[0].reader`` to each of ``blocks[0].receivers`` in a round: one
    block, or blocks smaller than ``pack_below`` packed at aligned offsets in tag order.  ``start``: its
    slot in this rank's buffer (``None``: it travels in place)."""

    blocks: list[SharedBlock]
    start: int | None = None

    @property
    def tag(self) -> int:
        return self.blocks[0].tag

    @property
    def offsets(self) -> list[int]:
        at, out = 0, []
        for block in self.blocks:
            out.append(at)
            at += aligned(block.nbytes)
        return out

    @property
    def nbytes(self) -> int:
        return self.offsets[-1] + self.blocks[-1].nbytes


@dataclass
class PreparedExchange:
    """This rank's messages of an exchange, by round, and the buffer its staged ones travel through."""

    outgoing: dict[int, list[Message]]
    incoming: dict[int, list[Message]]
    device: torch.device
    buffer: TransferBuffer | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.nbytes


def prepare_exchange(plan: SharedReads, dist: Dist, *, wire: torch.device | None = None) -> PreparedExchange:
    """Cut this rank's messages and allocate the buffer its staged ones need (at most one round), before
    the ranks agree to send: a failure here (a GPU out of memory) must fail every rank at that agreement.
    Local: no collective.  ``wire``: the device the bytes travel from; ``None`` takes the group's."""
    device = wire if wire is not None else (dist.device() if plan.shared else torch.device("cpu"))
    prepared = PreparedExchange(_messages(plan.sends, plan.pack_below), _messages(plan.receives, plan.pack_below),
                                device)
    used: dict[int, int] = {}
    for round_index, messages in [*prepared.outgoing.items(), *prepared.incoming.items()]:
        for message in messages:
            if len(message.blocks) == 1 and _travels_in_place(message.blocks[0].view, device):
                continue
            message.start = used.get(round_index, 0)
            used[round_index] = message.start + aligned(message.nbytes)
    nbytes = max(used.values(), default=0)
    prepared.buffer = TransferBuffer(nbytes, device) if nbytes else None
    return prepared


def exchange(plan: SharedReads, dist: Dist, prepared: PreparedExchange | None = None, *,
             wire: torch.device | None = None) -> int:
    """Send the bytes this rank read to the ranks that need them too, and receive what others read;
    return the bytes of the staging buffer this rank held (at most the plan's ``round_bytes``).

    Call only after every rank's reads succeeded (the sender's targets hold
    checked bytes), with what :func:`prepare_exchange` returned on every rank
    before the ranks agreed to send; without ``prepared`` this call prepares
    (on ``wire``) and agrees first, raising the same error on every rank when
    any rank could not prepare.  Collective in spirit: every rank of the
    group takes part in each round, even one with nothing to send or receive
    in it.  A copy into or out of the buffer that fails does not stop the
    rounds (the peers are committed to them); the failure is raised once
    they are over.
    """
    if not plan.shared:
        return 0
    import torch.distributed as tdist

    if prepared is None:
        prepared = _prepared_on_every_rank(plan, dist, wire)
    buffer = prepared.buffer

    def global_rank(group_rank: int) -> int:
        return tdist.get_global_rank(dist.group, group_rank) if dist.group is not None else group_rank

    failure: BaseException | None = None
    with torch.no_grad(), dist.rounds():  # ranks take part in different numbers of rounds: one check-in
        for round_index in range(plan.rounds):
            ops, landing = [], []
            for message in prepared.outgoing.get(round_index, []):
                if message.start is None:
                    sent = _as_bytes(message.blocks[0].view)
                else:
                    sent = buffer.slot(message.start, message.nbytes)
                    try:
                        for block, offset in zip(message.blocks, message.offsets):
                            buffer.put(message.start + offset, block.view)
                    except Exception as exc:  # noqa: BLE001 - the peers wait for this round: raised after it
                        failure = failure or exc
                ops.extend(tdist.P2POp(tdist.isend, sent, global_rank(rank), dist.group, message.tag)
                           for rank in message.blocks[0].receivers)
            for message in prepared.incoming.get(round_index, []):
                if message.start is None:
                    target = _as_bytes(message.blocks[0].view)
                else:
                    target = buffer.slot(message.start, message.nbytes)
                    landing.append(message)
                ops.append(tdist.P2POp(tdist.irecv, target, global_rank(message.blocks[0].reader), dist.group,
                                       message.tag))
            dist.exchange(ops)
            for message in landing:
                try:
                    for block, offset in zip(message.blocks, message.offsets):
                        buffer.take(message.start + offset, block.view)
                except Exception as exc:  # noqa: BLE001 - later rounds still run: raised after them
                    failure = failure or exc
    if prepared.device.type == "cuda":
        torch.cuda.current_stream(prepared.device).synchronize()
    if failure is not None:
        raise failure
    log.debug("rank %d sent %d and received %d blocks in %d rounds through a %d-byte buffer on %s",
              dist.group_rank, len(plan.sends), len(plan.receives), plan.rounds, prepared.nbytes, prepared.device)
    return prepared.nbytes


def _prepared_on_every_rank(plan: SharedReads, dist: Dist, wire: torch.device | None) -> PreparedExchange:
    """:func:`prepare_exchange`, then one agreement: a rank that could not prepare raises its own error,
    the others the same shardkit class naming it, so none waits in a round for a peer that never comes."""
    prepared, failure, record = None, None, None
    try:
        prepared = prepare_exchange(plan, dist, wire=wire)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
        failure, record = exc, error_record(exc)
    first = dist.first_error(record)
    if first is None:
        assert prepared is not None
        return prepared
    if failure is not None:
        raise failure
    rank, theirs = first
    raise from_record(theirs, f"rank {rank} could not set up the exchange of shared reads ({theirs['type']}: "
                              f"{theirs['message']}); no block was sent")


def _messages(blocks: Sequence[SharedBlock], pack_below: int) -> dict[int, list[Message]]:
    """The messages of ``blocks`` by round, each round's in the order of their first tag: the same cut on
    the reader and on every receiver, so sends and receives pair up in order (NCCL matches them so)."""
    by_round: dict[int, list[Message]] = {}
    packed: dict[tuple[int, int, tuple[int, ...]], Message] = {}
    for block in sorted(blocks, key=lambda b: b.tag):
        key = (block.round, block.reader, block.receivers)
        if block.nbytes < pack_below and key in packed:
            packed[key].blocks.append(block)
            continue
        message = Message([block])
        by_round.setdefault(block.round, []).append(message)
        if block.nbytes < pack_below:
            packed[key] = message
    return by_round


def _travels_in_place(view: torch.Tensor, device: torch.device) -> bool:
    """Whether ``view`` can be sent or received as it is: contiguous memory on the wire's device."""
    same_device = view.device.type == device.type and (device.index is None or view.device.index == device.index)
    return same_device and view.is_contiguous()


def _as_bytes(view: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as ``uint8``: both ends of a message see bytes, whatever the dtype."""
    return view.reshape(-1).view(torch.uint8)
