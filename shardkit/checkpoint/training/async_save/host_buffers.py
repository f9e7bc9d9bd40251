"""Host staging for ``async_save``: one grow-only buffer, reused from save to save.

Why this shape:

* **Flat host memory.**  The state must be copied before training changes it,
  but the copy lands in a buffer that is kept and reused: the second and
  later saves of the same state allocate nothing (a fresh allocation costs a
  page fault per page; a reused one runs at memcpy speed).  The buffer grows
  only if the state grows.
* **Shareable.**  For the writer process the buffer is shared memory (a Linux
  ``memfd``, else a temporary file removed as soon as the writer mapped it), so
  the staged bytes reach the writer without another copy or any pickling;
  :meth:`StagingPool.location` says where a staged chunk lies in it.
* **CUDA.**  The buffer is page-locked when the state lives on a GPU, and the
  device-to-host copies run on a side stream without blocking the training
  thread: kernels it queues after the save wait for the copy (stream order),
  and the writer waits for it (:meth:`StagingPool.wait_copied`) before it reads.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
import uuid
from dataclasses import replace
from typing import Any, Iterable

import torch

from shardkit.checkpoint.formats.base import WriteChunk
from shardkit.checkpoint.io.rounds import aligned

__all__ = ["StagingPool", "HostBuffer"]

log = logging.getLogger(__name__)


class HostBuffer:
    """``size`` bytes of host memory as a ``uint8`` tensor; shared ones carry how another process maps them."""

    def __init__(self, size: int, *, shared: bool, pinned: bool) -> None:
        self.size = size
        self.pinned = False
        self._mmap: mmap.mmap | None = None
        self._fd: int | None = None
        self.path: str | None = None  # where the writer process opens it
        self.token = uuid.uuid4().hex  # tells buffers apart: a later one may reuse the path (a freed fd number)
        self.unlink_when_mapped: str | None = None  # a named file to remove once the writer has it open
        if shared:
            self._fd, self.path, self.unlink_when_mapped = _shared_file(size)
            self._mmap = mmap.mmap(self._fd, size)
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        else:
            self.tensor = torch.empty(size, dtype=torch.uint8)
        if pinned:
            self._pin()

    def _pin(self) -> None:
        result = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0)
        self.pinned = int(result) == 0
        if not self.pinned:
            log.warning("could not page-lock the %d-byte staging buffer (cudaHostRegister returned %s); "
                        "device-to-host copies will be slower", self.size, result)

    def mapped(self) -> None:
        """The writer process has the buffer open: a named file can go now."""
        if self.unlink_when_mapped is not None:
            _remove(self.unlink_when_mapped)
            self.unlink_when_mapped = None

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a staged view is still alive somewhere; the mapping goes with it
                pass
            self._mmap = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.mapped()


def _shared_file(size: int) -> tuple[int, str, str | None]:
    """An open file of ``size`` bytes another process of this user can map: ``(fd, path, name_to_remove)``.

    A Linux memfd has no name anywhere, so a killed job leaves nothing behind;
    elsewhere a temporary file is removed once the writer has mapped it.
    """
    if hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd"):
        fd = os.memfd_create("shardkit-staging", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return fd, f"/proc/{os.getpid()}/fd/{fd}", None
    fd, path = tempfile.mkstemp(prefix="shardkit-staging-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.ftruncate(fd, size)
    return fd, path, path


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class StagingPool:
    """A grow-only host buffer that staged chunks are copied into (see the module docstring).

    ``shared``: the buffer is shared memory a writer process can map.
    """

    def __init__(self, *, shared: bool = False) -> None:
        self.shared = shared
        self.buffer: HostBuffer | None = None
        self._copied: Any = None  # the CUDA event the last staging's copies record
        self._staged: tuple[list, HostBuffer, list[list[WriteChunk]], list[torch.Tensor]] | None = None
        # (layout, buffer, chunks, each chunk's data in order)
        self._on_cuda = False
        self.staged_token: str | None = None  # names the chunks the last stage placed (None: none are kept)

    def stage(self, groups: list[list[WriteChunk]]) -> list[list[WriteChunk]]:
        """Copy every chunk's data into the pool; return chunks that point at the copies.

        The staged chunks of the last call are kept: a save of the same chunks
        into the same buffer (every save of a training run after the first) only copies.
        """
        layout = [[(c.fqn, c.dtype, c.offsets, c.shape, c.tensor_shape) for c in g] for g in groups]
        total = sum(aligned(c.nbytes) for g in groups for c in g)
        on_cuda = any(isinstance(c.data, torch.Tensor) and c.data.is_cuda for g in groups for c in g)
        if self.buffer is None or self.buffer.size < total or (on_cuda and not self.buffer.pinned):
            self.release()  # let the old one go before taking the new one
            self.buffer = HostBuffer(max(total, 1), shared=self.shared, pinned=on_cuda)
        if self._staged is None or self._staged[0] != layout or self._staged[1] is not self.buffer:
            placed = self._place(groups)
            self._staged = (layout, self.buffer, placed, [s.data for g in placed for s in g])
            self.staged_token = uuid.uuid4().hex
        self._on_cuda = on_cuda
        self._copy(self._staged[3], (c.data if isinstance(c.data, torch.Tensor) else c.materialize()  # one at a time
                                     for g in groups for c in g))
        return self._staged[2]

    def restage(self, sources: list[torch.Tensor]) -> list[list[WriteChunk]]:
        """Copy ``sources`` -- one per chunk, in the order of the last :meth:`stage` -- over that stage's
        copies and return its chunks: a save of the same chunks, with nothing to work out but the copy."""
        assert self._staged is not None
        if len(sources) != len(self._staged[3]):
            raise ValueError(f"restage got {len(sources)} sources for {len(self._staged[3])} staged chunks")
        self._copy(self._staged[3], sources)
        return self._staged[2]

    def _copy(self, dsts: list[torch.Tensor], srcs: Iterable[torch.Tensor]) -> None:
        """``dst.copy_(src)`` pairwise; on CUDA on a side stream the training stream waits for.

        Host sources in one list go in one ``_foreach_copy_`` call: a repeat save of hundreds of tensors
        blocks for the copy, not for hundreds of Python-level calls."""
        if not self._on_cuda and isinstance(srcs, list) and hasattr(torch, "_foreach_copy_"):
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)
            return
        stream = torch.cuda.Stream() if self._on_cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            for dst, src in zip(dsts, srcs, strict=True):
                dst.copy_(src, non_blocking=src.is_cuda)
        if stream is not None:
            self._copied = stream.record_event()
            torch.cuda.current_stream().wait_event(self._copied)  # later kernels must not change it mid-copy

    def _place(self, groups: list[list[WriteChunk]]) -> list[list[WriteChunk]]:
        """Chunks like ``groups``' whose data are consecutive, aligned views of the buffer."""
        assert self.buffer is not None
        out, pos = [], 0
        for group in groups:
            placed = []
            for chunk in group:
                raw = self.buffer.tensor[pos:pos + chunk.nbytes]
                data = raw.view(chunk.dtype).view(chunk.shape) if chunk.shape else raw.view(chunk.dtype)[0]
                placed.append(replace(chunk, data=data))
                pos += aligned(chunk.nbytes)
            out.append(placed)
        return out

    def wait_copied(self) -> None:
        """Block until the last staging's device-to-host copies are done (no-op without CUDA)."""
        copied, self._copied = self._copied, None
        if copied is not None:
            copied.synchronize()

    def location(self, chunk: WriteChunk) -> int:
        """Byte offset of a staged chunk's data in the buffer."""
        assert self.buffer is not None and isinstance(chunk.data, torch.Tensor)
        return chunk.data.data_ptr() - self.buffer.tensor.data_ptr()

    def release(self) -> None:
        self._staged, self.staged_token = None, None
        if self.buffer is not None:
            self.wait_copied()
            self.buffer.close()
            self.buffer = None
