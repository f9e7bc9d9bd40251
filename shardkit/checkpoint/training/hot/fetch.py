"""A peer's copy received straight into memory and checked as its bytes arrive: a recovery from peers.

A rank whose node lost its copy needs the replica another node keeps, once, to apply it; writing it to a
staging directory, publishing it and reading it back only to remove it afterwards costs two passes over the
bytes and a disk the recovery does not need.  So here:

* the holder maps its copy's files (no copy of its own) and sends the manifest, then the data file in
  chunks of :data:`CHUNK_BYTES`, every send posted at once (one arrival for every rank of the group, as
  any round of transfers; no collective of its own);
* the receiver posts a receive per chunk into one buffer the size the holder's listing gave, checks the
  manifest as soon as it lands, and checks the crc32c of every tensor whose bytes have all arrived while
  the next chunks are still on the wire -- no second pass, and nothing written to any disk.  What a
  receiver holds in the end is a :class:`~.flat.FlatCopy` whose every byte was checked, or the reason it
  is not one.

A holder that cannot read its copy still sends (zeros), so its receiver never waits for bytes that will
not come: the bytes then fail the receiver's checks, and the holder reports why in the exchange that
follows (the caller's).  Nothing here raises for a damaged or missing copy; a peer that dies or freezes
fails the transfer within the deadline as any collective does.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.local_files import map_file, read_whole
from shardkit.checkpoint.training.hot.flat import (
    DATA_NAME,
    MANIFEST_NAME,
    Entry,
    FlatCopy,
    checked_tensor,
    entries_of,
    parse_manifest,
)
from shardkit.errors import CorruptCheckpoint, ShardkitError
from shardkit.wire.arrival import complete

__all__ = ["Pull", "Fetched", "fetch_copies", "CHUNK_BYTES"]

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
    """Run ``pulls`` (the same list on every rank of ``group``, at most one per receiver); collective."""
    dist_ = Dist(group)
    dist_.phase = "recover"
    me = dist_.group_rank
    sends: list[tuple[int, Pull, list[torch.Tensor]]] = []
    failed_sends: dict[str, str] = {}
    receive: tuple[int, Pull, _Incoming] | None = None
    for i, pull in enumerate(pulls):
        sizes = _sizes(pull)
        if pull.src == me:
            pieces, why = _outgoing(pull, sizes)
            if why is not None:
                failed_sends[pull.source_dir] = why
            sends.append((i, pull, pieces))
        elif pull.dst == me:
            receive = (i, pull, _Incoming(pull, sizes))
    import torch.distributed as dist

    with dist_.rounds():  # every rank checks in once, even one with no part in any pull
        ops = [dist.P2POp(dist.isend, piece, group=dist_.group, group_peer=pull.dst, tag=i * _TAGS_PER_PULL + k)
               for i, pull, pieces in sends for k, piece in enumerate(pieces)]
        if receive is not None:
            i, pull, incoming = receive
            ops += [dist.P2POp(dist.irecv, piece, group=dist_.group, group_peer=pull.src,
                               tag=i * _TAGS_PER_PULL + k) for k, piece in enumerate(incoming.pieces)]
        works = dist.batch_isend_irecv(ops) if ops else []
        landing = works[len(ops) - len(receive[2].pieces):] if receive is not None else []
        for k, work in enumerate(landing):  # in the order they arrive: each checked while the next lands
            complete(work, pollable=False)
            receive[2].landed(k)
        for work in works[:len(works) - len(landing)]:
            complete(work, pollable=False)
    if receive is None:
        return Fetched(None, None, failed_sends)
    copy, problem = receive[2].result()
    return Fetched(copy, problem, failed_sends)


def _sizes(pull: Pull) -> tuple[int, int]:
    """The manifest's and the data file's sizes from the holder's listing (0 for a file it lacks)."""
    sizes = dict(pull.files)
    return int(sizes.get(MANIFEST_NAME, 0)), int(sizes.get(DATA_NAME, 0))


def _chunks(buffer: torch.Tensor) -> list[torch.Tensor]:
    return [buffer[start:start + CHUNK_BYTES] for start in range(0, buffer.numel(), CHUNK_BYTES)]


def _nonempty(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """What goes on the wire: both ends drop the same empty pieces (they derive them from the same sizes)."""
    return [p for p in pieces if p.numel()]


def _outgoing(pull: Pull, sizes: tuple[int, int]) -> tuple[list[torch.Tensor], str | None]:
    """The holder's pieces: the manifest's bytes, then the mapped data file in chunks; zeros of the listed
    sizes (and why) when the copy cannot be read as listed."""
    manifest_size, data_size = sizes
    try:
        raw = read_whole(os.path.join(pull.source_dir, MANIFEST_NAME))
        if len(raw) != manifest_size:
            raise CorruptCheckpoint(f"{pull.source_dir}/{MANIFEST_NAME} holds {len(raw)} bytes; {manifest_size} "
                                    f"were listed")
        manifest = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        data = map_file(os.path.join(pull.source_dir, DATA_NAME), data_size)
        return _nonempty([manifest, *_chunks(data)]), None
    except (ShardkitError, OSError) as exc:
        why = f"rank {pull.src} cannot send {pull.source_dir}: {exc}"
        log.warning("hot tier: %s", why)
        return _nonempty([torch.zeros(manifest_size, dtype=torch.uint8),
                          *_chunks(torch.zeros(data_size, dtype=torch.uint8))]), why


class _Incoming:
    """The receiving end: one buffer per file, checked as each chunk lands."""

    def __init__(self, pull: Pull, sizes: tuple[int, int]) -> None:
        manifest_size, data_size = sizes
        self.source = pull.source_dir
        self.where = f"rank {pull.src}'s {pull.source_dir}"
        self.manifest_bytes = torch.empty(manifest_size, dtype=torch.uint8)
        self.data = torch.empty(data_size, dtype=torch.uint8)
        self.pieces = _nonempty([self.manifest_bytes, *_chunks(self.data)])
        self._data_bytes = [0 if p is self.manifest_bytes else p.numel() for p in self.pieces]
        self.manifest: dict[str, Any] | None = None
        self.entries: list[Entry] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.problem: str | None = None
        self._next = 0  # the first entry not yet checked
        self._received = 0  # bytes of the data file landed so far

    def landed(self, k: int) -> None:
        """Piece ``k`` arrived: check the manifest (the first piece), then every tensor now wholly received."""
        self._received += self._data_bytes[k]
        if self.problem is not None:
            return
        try:
            if self.manifest is None:
                self.manifest = parse_manifest(self.manifest_bytes.numpy().tobytes(), f"{self.where}/{MANIFEST_NAME}")
                if self.manifest["size"] != self.data.numel():
                    raise CorruptCheckpoint(f"{self.where}/{DATA_NAME} was listed with {self.data.numel()} bytes; "
                                            f"its manifest says {self.manifest['size']}")
                self.entries = entries_of(self.manifest, self.source)
            while self._next < len(self.entries) and self.entries[self._next].end <= self._received:
                entry = self.entries[self._next]
                self.tensors[entry.key] = checked_tensor(entry, self.data, f"{self.where}/{DATA_NAME}")
                self._next += 1
        except ShardkitError as exc:
            self.problem = str(exc)
            self.tensors.clear()

    def result(self) -> tuple[FlatCopy | None, str | None]:
        if self.problem is None and self.manifest is not None and self._next == len(self.entries):
            return FlatCopy(self.source, self.manifest["meta"], self.tensors, self.manifest["values"]), None
        return None, self.problem or f"the copy from {self.where} did not arrive whole"
