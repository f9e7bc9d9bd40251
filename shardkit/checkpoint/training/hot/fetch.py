"""A peer's copy received straight into memory -- into the tensors it restores -- and checked as its bytes
arrive: a recovery from peers.

A rank whose node lost its copy needs the replica another node keeps, once, to apply it; staging it on disk,
or in a fresh buffer only to copy it into the targets afterwards, costs passes over the bytes (and, for a
fresh buffer, its pages) the recovery does not need.  So a fetch is two rounds of transfers
(:class:`PeerFetch`), every send of a round posted at once (one arrival for every rank of the group, as any
round of transfers; no collective of its own):

1. **manifests** -- each holder sends its copy's manifest; each receiver checks it and learns the copy's
   layout (every tensor's key, dtype, shape, offset, crc32c).  Nothing is written: the caller checks the
   layout against its state and agrees with the other ranks (input state that cannot be restored as asked
   is refused before any target is written) before it asks for
2. **data** -- the holder maps its data file and sends it in pieces cut along that layout (each tensor in
   pieces of at most :data:`CHUNK_BYTES`, the padding between tensors); the receiver posts each piece's
   receive straight into its destination -- the target tensor itself when it is a contiguous CPU tensor,
   else a buffer of its own -- and checks every tensor's crc32c as its last piece lands, while the next
   ones are still on the wire.  A damaged byte is thus found with the target written: the caller treats
   the targets as touched (:mod:`.recover`).

Both ends cut the pieces from the same manifest bytes and the holder's listing, so they always agree on
them; when the manifest is unusable both fall back to plain chunks of the listed size.  A holder that
cannot read its copy still sends (zeros), so its receiver never waits for bytes that will not come: the
bytes then fail the receiver's checks, and the holder reports why in the exchange that follows (the
caller's).  Nothing here raises for a damaged or missing copy; a peer that dies or freezes fails the
transfer within the deadline as any collective does.  :func:`fetch_copies` runs both rounds into fresh
tensors (a copy received whole).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from shardkit.checkpoint.formats.crc32c import crc32c
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.local_files import map_file, read_whole, release_in_background
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.training.hot.flat import DATA_NAME, MANIFEST_NAME, Entry, FlatCopy, entries_of, parse_manifest
from shardkit.errors import CorruptCheckpoint, ShardkitError
from shardkit.wire.arrival import complete

__all__ = ["Pull", "Fetched", "fetch_copies", "PeerFetch", "Received", "CHUNK_BYTES"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # one receive: small enough that checking one overlaps the arrival of the next
_TAGS_PER_PULL = 1 << 20


@dataclass(frozen=True)
class Pull:
    """Rank ``dst`` receives the copy at ``source_dir`` on rank ``src``, whose files the holder listed as
    ``files`` (name and size; the manifest and the data file)."""

    src: int
    source_dir: str
    dst: int
    files: Sequence[tuple[str, int]]


@dataclass
class Fetched:
    """What this rank got out of the pulls: ``copy`` (received, every byte checked) or ``problem`` (why not)
    for the one it receives, and ``failed_sends`` (source directory: why) for those it could not send."""

    copy: FlatCopy | None
    problem: str | None
    failed_sends: dict[str, str]


def fetch_copies(pulls: Sequence[Pull], group: Any = None) -> Fetched:
    """Run ``pulls`` (the same list on every rank of ``group``, at most one per receiver) whole, both rounds,
    into fresh tensors; collective."""
    fetch = PeerFetch(pulls, group)
    received = fetch.manifests()
    copy = None
    if received is not None and received.problem is None:
        copy = FlatCopy(received.where, received.manifest["meta"],
                        {e.key: torch.empty(e.shape, dtype=e.dtype) for e in received.entries},
                        received.manifest["values"])
    problem = fetch.data(None if copy is None else copy.tensors)
    if received is None:
        return Fetched(None, None, fetch.failed_sends)
    if problem is not None or copy is None:
        return Fetched(None, problem or received.problem, fetch.failed_sends)
    return Fetched(copy, None, fetch.failed_sends)


@dataclass
class Received:
    """A receiver's manifest after the first round: ``manifest`` and its ``entries`` (file order), or the
    ``problem`` with it; ``where`` names the holder's copy."""

    where: str
    source: str
    manifest: dict[str, Any] | None
    entries: list[Entry]
    problem: str | None


class PeerFetch:
    """The two rounds of a fetch (see the module docstring), on every rank of ``group`` in the same order:
    :meth:`manifests`, then :meth:`data` (both collective)."""

    def __init__(self, pulls: Sequence[Pull], group: Any = None) -> None:
        self.pulls = list(pulls)
        self.dist = Dist(group)
        self.dist.phase = "recover"
        me = self.dist.group_rank
        self.sends = [(i, pull) for i, pull in enumerate(self.pulls) if pull.src == me]
        self.receive = next(((i, pull) for i, pull in enumerate(self.pulls) if pull.dst == me), None)
        self.failed_sends: dict[str, str] = {}
        self._sent: dict[int, bytes | None] = {}  # each send's manifest bytes (None: unreadable)
        self._received: Received | None = None
        self._manifest_in: torch.Tensor | None = None

    def manifests(self) -> Received | None:
        """Round 1: the manifests; this rank's :class:`Received` (``None`` when it receives nothing)."""
        outgoing = []
        for i, pull in self.sends:
            raw, why = _manifest_out(pull)
            self._sent[i] = raw
            if why is not None:
                self.failed_sends[pull.source_dir] = why
            size = _sizes(pull)[0]
            outgoing.append((i, pull, [torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
                                       else torch.zeros(size, dtype=torch.uint8)]))
        incoming = None
        if self.receive is not None:
            self._manifest_in = torch.empty(_sizes(self.receive[1])[0], dtype=torch.uint8)
            incoming = (self.receive[0], self.receive[1], [self._manifest_in], lambda k: None)
        self._round(outgoing, incoming)
        if self.receive is None:
            return None
        i, pull = self.receive
        where = f"rank {pull.src}'s {pull.source_dir}"
        manifest, entries, problem = None, [], None
        try:
            manifest = parse_manifest(self._manifest_in.numpy().tobytes(), f"{where}/{MANIFEST_NAME}")
            if manifest["size"] != _sizes(pull)[1]:
                raise CorruptCheckpoint(f"{where}/{DATA_NAME} was listed with {_sizes(pull)[1]} bytes; its "
                                        f"manifest says {manifest['size']}")
            entries = entries_of(manifest, pull.source_dir)
        except ShardkitError as exc:
            manifest, entries, problem = None, [], str(exc)
        self._received = Received(where, pull.source_dir, manifest, entries, problem)
        return self._received

    def data(self, into: dict[str, torch.Tensor] | None,
             meanwhile: Callable[[], None] | None = None) -> str | None:
        """Round 2: the data files, each tensor received into ``into[key]`` (this rank's destinations, by the
        received manifest's keys; any tensor without one lands in a buffer of its own) and checked as it
        lands.  ``meanwhile()`` runs once every send and receive is posted, while they travel (a holder
        reads its own copy into its targets then).  The receiver's problem (``None``: every byte checked),
        else ``None``."""
        outgoing = []
        for i, pull in self.sends:
            pieces, why = _data_out(pull, self._sent.get(i))
            if why is not None:
                self.failed_sends.setdefault(pull.source_dir, why)
            outgoing.append((i, pull, pieces))
        incoming, check = None, None
        if self.receive is not None:
            i, pull = self.receive
            check = _Landing(self._received, _sizes(pull)[1], into or {})
            incoming = (i, pull, check.pieces, check.landed)
        self._round(outgoing, incoming, meanwhile)
        # the sent pieces view the holder's mapped copy: unmapping tens of MB is not this recovery's to wait for
        release_in_background([pieces for _, _, pieces in outgoing])
        outgoing.clear()
        return None if check is None else check.result()

    def _round(self, outgoing: list[tuple[int, Pull, list[torch.Tensor]]],
               incoming: tuple[int, Pull, list[torch.Tensor], Any] | None,
               meanwhile: Callable[[], None] | None = None) -> None:
        """One round of transfers: every send and receive posted at once, then ``meanwhile()``; each receive
        handed to its ``landed(k)`` as it completes, in order."""
        import torch.distributed as dist

        group = self.dist.group
        with self.dist.rounds():  # every rank checks in once, even one with no part in any pull
            ops = [dist.P2POp(dist.isend, piece, group=group, group_peer=pull.dst, tag=i * _TAGS_PER_PULL + k)
                   for i, pull, pieces in outgoing for k, piece in enumerate(_nonempty(pieces))]
            landing_pieces = _nonempty(incoming[2]) if incoming is not None else []
            if incoming is not None:
                i, pull = incoming[0], incoming[1]
                ops += [dist.P2POp(dist.irecv, piece, group=group, group_peer=pull.src,
                                   tag=i * _TAGS_PER_PULL + k) for k, piece in enumerate(landing_pieces)]
            works = dist.batch_isend_irecv(ops) if ops else []
            if meanwhile is not None:
                meanwhile()
            landing = works[len(ops) - len(landing_pieces):] if landing_pieces else []
            for k, work in enumerate(landing):  # in the order they arrive: each checked while the next lands
                complete(work, pollable=False)
                incoming[3](k)
            for work in works[:len(works) - len(landing)]:
                complete(work, pollable=False)


def _sizes(pull: Pull) -> tuple[int, int]:
    """The manifest's and the data file's sizes from the holder's listing (0 for a file it lacks)."""
    sizes = dict(pull.files)
    return int(sizes.get(MANIFEST_NAME, 0)), int(sizes.get(DATA_NAME, 0))


def _nonempty(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """What goes on the wire: both ends drop the same empty pieces (they derive them from the same sizes)."""
    return [p for p in pieces if p.numel()]


def _entries(raw: bytes | None, data_size: int, where: str) -> list[Entry] | None:
    """The entries of the manifest ``raw`` when it is sound and matches the listed ``data_size``; else
    ``None``.  Both ends call this on the same bytes (the holder on what it sent, the receiver on what
    arrived), so they agree on how the data file is cut."""
    try:
        if raw is None:
            return None
        manifest = parse_manifest(raw, where)
        return entries_of(manifest, where) if manifest["size"] == data_size else None
    except ShardkitError:
        return None


def _plan(entries: list[Entry] | None, data_size: int) -> list[tuple[int, int, str | None]]:
    """The data file's pieces as ``(start, end, key)`` (``key`` ``None``: padding, or a plain chunk): cut
    along ``entries`` (file order), or plain chunks of :data:`CHUNK_BYTES` without them."""
    if entries is None:
        return [(s, min(s + CHUNK_BYTES, data_size), None) for s in range(0, data_size, CHUNK_BYTES)]
    pieces: list[tuple[int, int, str | None]] = []
    at = 0
    for e in entries:
        if e.offset > at:
            pieces.append((at, e.offset, None))
        pieces += [(s, min(s + CHUNK_BYTES, e.end), e.key) for s in range(e.offset, e.end, CHUNK_BYTES)]
        at = max(at, e.end)
    if data_size > at:
        pieces.append((at, data_size, None))
    return pieces


def _manifest_out(pull: Pull) -> tuple[bytes | None, str | None]:
    """The holder's manifest bytes as listed, or ``None`` and why (its receiver then gets zeros)."""
    manifest_size, data_size = _sizes(pull)
    try:
        raw = read_whole(os.path.join(pull.source_dir, MANIFEST_NAME))
        if len(raw) != manifest_size:
            raise CorruptCheckpoint(f"{pull.source_dir}/{MANIFEST_NAME} holds {len(raw)} bytes; {manifest_size} "
                                    f"were listed")
        found = Storage(pull.source_dir).size(DATA_NAME)
        if found != data_size:
            raise CorruptCheckpoint(f"{pull.source_dir}/{DATA_NAME} holds {found} bytes; {data_size} were listed")
        return raw, None
    except (ShardkitError, OSError) as exc:
        why = f"rank {pull.src} cannot send {pull.source_dir}: {exc}"
        log.warning("hot tier: %s", why)
        return None, why


def _data_out(pull: Pull, raw: bytes | None) -> tuple[list[torch.Tensor], str | None]:
    """The holder's data file, mapped, in the pieces of :func:`_plan`; zeros of those sizes (and why) when it
    cannot be read as listed."""
    data_size = _sizes(pull)[1]
    plan = _plan(_entries(raw, data_size, pull.source_dir), data_size)
    try:
        if raw is None:
            raise CorruptCheckpoint("its manifest could not be read")
        data = map_file(os.path.join(pull.source_dir, DATA_NAME), data_size)
        return [data[start:end] for start, end, _ in plan], None
    except (ShardkitError, OSError) as exc:
        why = f"rank {pull.src} cannot send {pull.source_dir}: {exc}"
        return [torch.zeros(end - start, dtype=torch.uint8) for start, end, _ in plan], why


class _Landing:
    """The receiving end of round 2: each piece's destination, and every tensor checked as its last piece
    lands."""

    def __init__(self, received: Received | None, data_size: int, into: dict[str, torch.Tensor]) -> None:
        usable = received is not None and received.manifest is not None and received.problem is None
        self.where = received.where if received is not None else ""
        self.problem: str | None = None if usable else (received.problem if received is not None
                                                          else "nothing received")
        plan = _plan(received.entries if usable else None, data_size)
        self.entries = {e.key: e for e in received.entries} if usable else {}
        self.pieces: list[torch.Tensor] = []
        self._keys: list[str | None] = []
        self._crcs: dict[str, int] = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        views: dict[str, torch.Tensor] = {}
        for start, end, key in plan:
            if key is None or not usable:
                self.pieces.append(torch.empty(end - start, dtype=torch.uint8))
                self._keys.append(None)
                continue
            if key not in views:
                views[key] = self._destination(self.entries[key], into.get(key))
            offset = start - self.entries[key].offset
            self.pieces.append(views[key][offset:offset + end - start])
            self._keys.append(key)
        self._landed_of = {key: 0 for key in views}

    def _destination(self, entry: Entry, target: torch.Tensor | None) -> torch.Tensor:
        """``entry``'s bytes' destination as a flat byte view: the target itself when it is a contiguous
        CPU tensor of the entry's dtype and shape, else a buffer of its own copied into it once checked."""
        fits = (target is not None and target.device.type == "cpu" and target.is_contiguous()
                and target.dtype == entry.dtype and list(target.shape) == entry.shape)
        into = target.detach() if fits else torch.empty(entry.shape, dtype=entry.dtype)
        if target is not None and not fits:
            self._copies.append((target, into))
        return into.reshape(-1).view(torch.uint8)

    def landed(self, k: int) -> None:
        """Piece ``k`` arrived: fold it into its tensor's crc32c; check the tensor once it is whole."""
        key = self._keys[k]
        if key is None or self.problem is not None:
            return
        piece = self.pieces[k]
        self._crcs[key] = crc32c(piece, self._crcs.get(key, 0))
        self._landed_of[key] += piece.numel()
        entry = self.entries[key]
        if self._landed_of[key] == entry.nbytes and self._crcs[key] != entry.crc:
            self.problem = (f"{self.where}/{DATA_NAME}: the bytes of {entry.key!r} do not match their checksum "
                            f"(crc32c): a damaged copy")

    def result(self) -> str | None:
        if self.problem is None:
            missing = [key for key, e in self.entries.items() if e.nbytes and self._landed_of.get(key) != e.nbytes]
            if missing:
                self.problem = f"the copy from {self.where} did not arrive whole ({missing[0]!r})"
        if self.problem is None:
            with torch.no_grad():
                for target, into in self._copies:
                    target.copy_(into)
        return self.problem
