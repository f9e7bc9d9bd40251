"""Ordering between compute and communication: CUDA streams, or inline.

On an accelerator, all-gathers and reduce-scatters run on their own streams
so they overlap with compute.  Buffers that cross streams are kept alive by
Python references until an event says the consumer is done with them; the
runtime never calls ``record_stream`` (whose deferred frees make peak memory
depend on timing).

On the CPU there are no streams: every collective is issued inline, and
overlap comes only from ``async_op=True`` work handles (gloo runs them on its
own threads).  Because a synchronous collective's result is consumed before
the next one starts, the CPU path reuses one :class:`Workspace` for every
all-gather output and reduce-scatter input instead of allocating (and
page-faulting) fresh buffers each time.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["Workspace", "CommContext"]


class Workspace:
    """One growable byte buffer for transient collective buffers.

    Safe only for work that is finished before the next ``take``: the
    synchronous CPU path.  It grows to the largest request (one group's
    unsharded size) during a pass; the root releases it at the end of
    forward and of backward, so between passes no copy of unsharded data
    stays alive and the memory is free for activations."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        buffer = self._buffer
        if buffer is None or buffer.numel() < nbytes or buffer.device != device:
            buffer = self._buffer = None  # free the old one before allocating the new one
            buffer = self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def release(self) -> None:
        self._buffer = None


class CommContext:
    """Streams, events and reusable buffers shared by every group under one root.

    ``inline`` is True on the CPU (and any device without streams): then the
    stream and event methods are no-ops and collectives complete in order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.inline = device.type in ("cpu", "meta") or not hasattr(getattr(torch, device.type, None), "Stream")
        self.workspace = Workspace()
        # groups in the order their post-forward ran (with repeats): the
        # default backward prefetch target of group i is entry i - 1
        self.post_forward_order: list[Any] = []
        # (event, keep-alive) pairs of reduce-scatters still running on their stream
        self.pending_reduces: list[tuple[Any, Any]] = []
        self.streams: dict[str, Any] = {}
        if not self.inline:
            handle = getattr(torch, device.type)
            for name in ("all_gather", "reduce_scatter"):
                self.streams[name] = handle.Stream(priority=-1)

    # ------------------------------------------------------------- streams

    @contextlib.contextmanager
    def on(self, name: str) -> Iterator[None]:
        """Run the block on stream ``name`` after the current stream's work.

        Waiting on the current stream every time is what makes buffer reuse
        safe without ``record_stream``: a buffer allocated on ``name`` and
        freed after its consumer (on the current stream) enqueued its last
        use can only be handed out again to work ordered after that use.
        Overlap therefore comes from prefetching: a collective issued
        *before* the compute it should hide behind (explicit forward
        prefetch, the default backward prefetch, ``unshard(async_op=True)``)."""
        if self.inline:
            yield
            return
        handle = getattr(torch, self.device.type)
        stream = self.streams[name]
        stream.wait_stream(handle.current_stream())
        with handle.stream(stream):
            yield

    def record(self, name: str | None = None) -> Any:
        """An event on stream ``name`` (or the current stream); None inline."""
        if self.inline:
            return None
        handle = getattr(torch, self.device.type)
        stream = self.streams[name] if name else handle.current_stream()
        event = handle.Event()
        event.record(stream)
        return event

    def current_waits(self, event: Any) -> None:
        """Make the current stream wait for ``event`` (no-op inline)."""
        if event is not None and not self.inline:
            getattr(torch, self.device.type).current_stream().wait_event(event)

    def stream_waits(self, name: str, event: Any) -> None:
        if event is not None and not self.inline:
            self.streams[name].wait_event(event)

    # ------------------------------------------------------- reduce buffers

    def hold_until_done(self, event: Any, keep_alive: Any) -> None:
        """Keep ``keep_alive`` (reduce-scatter inputs, unsharded grads read on
        another stream) referenced until the current stream has waited on ``event``."""
        if not self.inline:
            self.pending_reduces.append((event, keep_alive))

    def wait_for_reduces(self) -> None:
        for event, _ in self.pending_reduces:
            self.current_waits(event)
        self.pending_reduces.clear()
