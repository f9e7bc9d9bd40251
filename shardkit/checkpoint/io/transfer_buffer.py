"""The one buffer a rank sends and receives bytes through, on whatever device its process group's wire needs.

gloo sends host memory, so there the buffer is one CPU tensor.  NCCL sends device memory only: the
buffer is then a page-locked host tensor plus one device tensor of the same size, and bytes cross
between them before a send and after a receive.  Both users -- the hot tier's directory moves
(:mod:`.transfer`, bytes from files) and a load's shared reads (bytes from tensors) -- slice it per
round, so the memory a transfer holds is the buffer's size whatever the size of what it moves.  The
device is an argument, not a guess from the backend, so the staging rounds run (and are tested) with
a CPU "wire" under gloo too.
"""

from __future__ import annotations

import torch

from shardkit.checkpoint.io.rounds import ALIGNMENT, nbytes_of

__all__ = ["TransferBuffer"]


class TransferBuffer:
    """``nbytes`` of wire memory on ``device`` (and, for a device other than the CPU, a page-locked host
    twin, allocated on first use: GPU-to-GPU transfers never need it), sliced per round by offset."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.pinned = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._view: memoryview | None = None
        self.wire = self.host if device.type == "cpu" else torch.empty(nbytes, dtype=torch.uint8, device=device)

    @property
    def host(self) -> torch.Tensor:
        """The host side: the wire itself on the CPU, else its page-locked twin."""
        return self._host if self._host is not None else self._allocate_host()[0]

    @property
    def view(self) -> memoryview:
        """:attr:`host` as a writable memoryview (files are read into it and written from it)."""
        return self._view if self._view is not None else self._allocate_host()[1]

    @property
    def on_host(self) -> bool:
        """Whether the wire is host memory itself (gloo), so no copy crosses between host and device."""
        return self.wire.device.type == "cpu"

    def _allocate_host(self) -> tuple[torch.Tensor, memoryview]:
        self._host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self._view = memoryview(self._host.numpy())
        return self._host, self._view

    def outgoing(self, start: int, n: int) -> torch.Tensor:
        """The tensor to send once ``view[start:start+n]`` holds the bytes."""
        if not self.on_host:
            self.wire[start:start + n].copy_(self.host[start:start + n])
        return self.wire[start:start + n]

    def landed(self, start: int, n: int) -> memoryview:
        """The received bytes of ``wire[start:start+n]``, readable on the host."""
        if not self.on_host:
            self.host[start:start + n].copy_(self.wire[start:start + n])
        return self.view[start:start + n]

    def put(self, start: int, source: torch.Tensor) -> torch.Tensor:
        """``source``'s bytes (any device, any strides) into the wire at ``start``; the wire slice to send.
        A source on the wire's device is copied there directly, one elsewhere through the host twin."""
        wire = self.wire_slice(start, source)
        if source.device == self.wire.device or self.on_host:
            wire.copy_(source)
        else:
            host = _typed(self.host, start, source)
            host.copy_(source)
            wire.copy_(host)
        return self.wire[start:start + nbytes_of(source)]

    def slot(self, start: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the wire at ``start`` (as ``uint8``): what a send carries or a receive fills."""
        return self.wire[start:start + nbytes]

    def take(self, start: int, target: torch.Tensor) -> None:
        """The received bytes at ``start`` into ``target`` (any device, any strides): directly from the wire
        when ``target`` lives on its device, else through the host twin."""
        wire = self.wire_slice(start, target)
        if target.device == self.wire.device or self.on_host:
            target.copy_(wire)
        else:
            host = _typed(self.host, start, target)
            host.copy_(wire)
            target.copy_(host)

    def wire_slice(self, start: int, like: torch.Tensor) -> torch.Tensor:
        """The wire at ``start`` seen as a contiguous tensor of ``like``'s dtype and shape."""
        return _typed(self.wire, start, like)


def _typed(flat: torch.Tensor, start: int, like: torch.Tensor) -> torch.Tensor:
    if start % ALIGNMENT:
        raise ValueError(f"offset {start} is not a multiple of {ALIGNMENT} bytes")
    return flat[start:start + nbytes_of(like)].view(like.dtype).view(like.shape)
