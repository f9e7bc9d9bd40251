"""Assemble any box of a tensor from the saved chunks that overlap it.

This is the read half of every offline conversion: a writer asks for the box
``(offsets, shape)`` it is about to write (a block of rows of one output
chunk), and :func:`fetch_box` reads just the overlapping rows of each saved
chunk and copies them into place.  Memory is the box plus one overlapping
piece, so a writer that asks for boxes of at most ``B`` bytes never holds more
than ~2·B, whatever the tensor or chunk sizes.

Saved chunks are indexed by their dim-0 start per tensor, so finding the
overlaps of a box costs a binary search, not a scan of every chunk.
"""

from __future__ import annotations

import bisect
import torch

from shardkit.checkpoint.offline_source import SavedChunk, Source, TensorEntry
from shardkit.errors import CorruptCheckpoint, IncompatibleStateDict

__all__ = ["Fetcher"]


class Fetcher:
    """Reads boxes of the tensors of one source, optionally converting dtype."""

    def __init__(self, source: Source, dtype_for: dict[str, torch.dtype] | None = None,
                 rename_back: dict[str, str] | None = None) -> None:
        self.source = source
        self.entries = source.tensors()
        self.dtype_for = dtype_for or {}
        self.rename_back = rename_back or {}
        self._index: dict[str, tuple[list[int], list[SavedChunk]]] = {}
        self.bytes_read = 0

    def _chunks(self, entry: TensorEntry) -> tuple[list[int], list[SavedChunk]]:
        idx = self._index.get(entry.fqn)
        if idx is None:
            chunks = sorted(entry.chunks, key=lambda c: (c.offsets[:1], c.offsets))
            idx = ([c.offsets[0] if c.offsets else 0 for c in chunks], chunks)
            self._index[entry.fqn] = idx
        return idx

    def entry(self, fqn: str) -> TensorEntry:
        src_name = self.rename_back.get(fqn, fqn)
        try:
            return self.entries[src_name]
        except KeyError:
            raise IncompatibleStateDict(f"{self.source.url}: no tensor {src_name!r}") from None

    def __call__(self, fqn: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        return self.fetch(fqn, offsets, shape)

    def fetch(self, fqn: str, offsets: tuple[int, ...], shape: tuple[int, ...],
              out: torch.Tensor | None = None) -> torch.Tensor:
        entry = self.entry(fqn)
        want = self.dtype_for.get(fqn, entry.dtype)
        if out is None:
            out = torch.empty(shape, dtype=want)
        if not entry.shape:  # a scalar has exactly one chunk
            piece = self.source.read_rows(entry, entry.chunks[0], 0, 1)
            out.copy_(piece.reshape(()))
            self.bytes_read += piece.element_size()
            return out
        if out.numel() == 0:
            return out
        starts, chunks = self._chunks(entry)
        lo, hi = offsets[0], offsets[0] + shape[0]
        covered = 0
        # chunks starting before the box end; walk back from there (chunks may be tall)
        stop = bisect.bisect_left(starts, hi)
        for chunk in chunks[:stop]:
            if chunk.offsets[0] + chunk.shape[0] <= lo:
                continue
            inter = _intersect(offsets, shape, chunk.offsets, chunk.shape)
            if inter is None:
                continue
            i_off, i_shape = inter
            r0 = i_off[0] - chunk.offsets[0]
            piece = self.source.read_rows(entry, chunk, r0, r0 + i_shape[0])
            self.bytes_read += piece.numel() * piece.element_size()
            src_index = (slice(None),) + tuple(slice(o - c, o - c + s) for o, c, s in
                                                 zip(i_off[1:], chunk.offsets[1:], i_shape[1:]))
            dst_index = tuple(slice(o - b, o - b + s) for o, b, s in zip(i_off, offsets, i_shape))
            out[dst_index].copy_(piece[src_index])
            covered += _numel(i_shape)
        if covered != out.numel():
            raise CorruptCheckpoint(f"{self.source.url}: tensor {entry.fqn!r} box {offsets}+{shape} is covered "
                                    f"{covered} of {out.numel()} elements by its saved chunks (holes/overlaps)")
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _intersect(a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: tuple[int, ...],
               b_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    off, shp = [], []
    for ao, as_, bo, bs in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        off.append(lo)
        shp.append(hi - lo)
    return tuple(off), tuple(shp)

