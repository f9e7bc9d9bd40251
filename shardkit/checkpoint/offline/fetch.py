"""Boxes of source tensors on demand: the read half of every offline conversion.

A writer asks for the box ``(offsets, shape)`` it is about to write (one output
chunk, or a block of rows of one), and :class:`Fetcher` plans it with the
engine's :func:`~shardkit.checkpoint.formats.base.plan_reads` (overlap of the
stored chunks with the box) and lets the source's reader fill it -- ranged,
checksum-verified reads for native, header-addressed ranges for safetensors.
Renames and dtype casts of the selection are applied here, so writers only
ever see output names and output dtypes; so is the dequantization of
blockwise-scaled FP8 weights (``scales``: output name -> source key of its
``_scale_inv``): ``out[i, j] = weight[i, j] * scale_inv[i // 128, j // 128]``
in float32, then cast.

Memory is the box (plus its cast, when casting), so a writer that asks for
boxes of at most ``B`` bytes holds ~2·B per thread whatever the tensor size.

On an object store the source is read through a block cache
(:func:`~shardkit.checkpoint.offline.read_through.read_through`): every box is served from 8 MiB blocks, each fetched
once with one ranged GET and read ahead of need, instead of a request per
stored piece of every box.  Its budget (``reserved_bytes``, a quarter of the
conversion's) is set aside before the writers size their concurrency.

With ``reuse=True`` each thread reads into one buffer it keeps and casts into a
second one (both grown to the largest box), and the returned tensor is a view
of one of them, valid until that thread's next fetch: on VMs that hand freed memory back to the host, fresh
allocations per chunk run at page-fault speed, reused ones at memory speed.  Writers
consume each box before asking for the next, so this is safe for them.
"""

from __future__ import annotations

import math
import threading
from typing import Mapping

import torch

from shardkit.checkpoint.formats.base import CheckpointReader, TensorEntry, plan_reads
from shardkit.checkpoint.formats.dtypes import itemsize
from shardkit.checkpoint.offline.options import cache_budget
from shardkit.checkpoint.offline.read_through import read_through
from shardkit.checkpoint.offline.select import SCALE_BLOCK
from shardkit.errors import IncompatibleStateDict

__all__ = ["Fetcher", "read_through", "cache_budget"]


class Fetcher:
    """``fetch(name, offsets, shape)`` → tensor, reading from ``reader`` (thread-safe if the reader is)."""

    def __init__(self, reader: CheckpointReader, dtype_for: Mapping[str, torch.dtype] | None = None,
                 rename_back: Mapping[str, str] | None = None, *, reuse: bool = False,
                 scales: Mapping[str, str] | None = None, reserved_bytes: int = 0) -> None:
        self.reader = reader
        self.reserved_bytes = reserved_bytes  # held for the source's reads (a block cache), apart from the boxes
        self.entries = reader.tensors()
        self.dtype_for = dict(dtype_for or {})
        self.rename_back = dict(rename_back or {})
        self._lock = threading.Lock()
        self._local = threading.local()
        self.reuse = reuse
        self.scales = dict(scales or {})
        self.bytes = 0

    @property
    def casts(self) -> bool:
        """Whether some box is cast (or dequantized) after its read: a second buffer per thread."""
        return bool(self.scales) or any(self.entry(name).dtype != dtype for name, dtype in self.dtype_for.items())

    def entry(self, name: str) -> TensorEntry:
        source = self.rename_back.get(name, name)
        try:
            return self.entries[source]
        except KeyError:
            raise IncompatibleStateDict(f"{self.reader.info.url}: no tensor {source!r}") from None

    def __call__(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        return self.fetch(name, offsets, shape)

    def fetch(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        entry = self.entry(name)
        buf = self._buffer(entry.dtype, tuple(shape)) if self.reuse else torch.empty(tuple(shape), dtype=entry.dtype)
        if buf.numel():
            self.reader.read(plan_reads(self.reader, [(entry.fqn, (tuple(offsets), tuple(shape)), buf)]))
        with self._lock:
            self.bytes += buf.numel() * buf.element_size()
        want = self.dtype_for.get(name, entry.dtype)
        if name in self.scales:
            return self._dequantized(buf, self.scales[name], offsets, shape).to(want)
        if want == entry.dtype:
            return buf
        if not self.reuse:
            return buf.to(want)
        out = self._buffer(want, tuple(shape), slot="cast")  # the cast reuses its own buffer too
        out.copy_(buf)
        return out

    def _dequantized(self, weight: torch.Tensor, scale_key: str, offsets: tuple[int, ...],
                     shape: tuple[int, ...]) -> torch.Tensor:
        """``weight`` (the box ``offsets``/``shape`` of an FP8 matrix) times its blocks' scales, in float32."""
        first = tuple(o // SCALE_BLOCK for o in offsets)
        count = tuple(-(-(o + n) // SCALE_BLOCK) - f for o, n, f in zip(offsets, shape, first))
        scale = torch.empty(count, dtype=self.entries[scale_key].dtype)
        if scale.numel():
            self.reader.read(plan_reads(self.reader, [(scale_key, (first, count), scale)]))
        rows, cols = (torch.arange(o, o + n) // SCALE_BLOCK - f for o, n, f in zip(offsets, shape, first))
        return weight.float() * scale.float()[rows][:, cols]

    def _buffer(self, dtype: torch.dtype, shape: tuple[int, ...], slot: str = "read") -> torch.Tensor:
        """A view of this thread's ``slot`` buffer, grown to the largest box seen (never shrunk)."""
        n = math.prod(shape) * itemsize(dtype)
        pool = getattr(self._local, slot, None)
        if pool is None or pool.numel() < n:
            pool = torch.empty(max(n, 1 << 16), dtype=torch.uint8)
            setattr(self._local, slot, pool)
        return pool[:n].view(dtype).view(shape)
