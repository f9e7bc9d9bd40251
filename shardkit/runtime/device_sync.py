"""Ordering between compute and communication: CUDA streams, or inline.

On an accelerator, all-gathers and reduce-scatters run on their own streams
so they overlap with compute.  Buffers that cross streams are kept alive by
Python references until an event says the consumer is done with them; the
runtime never calls ``record_stream`` (whose deferred frees make peak memory
depend on timing).

On the CPU there are no streams: every collective is issued inline, and
overlap comes only from ``async_op=True`` work handles (gloo runs them on its
own threads).

Collective buffers are allocated per use and dropped right after, like
torch's implementation does.  A reusable workspace for the synchronous CPU
path was tried and measured: no step-time gain within noise, and about one
root group's worth (16 MiB on the benchmark model) more peak RSS, because it
kept the largest all-gather buffer alive through the forward.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["CommContext"]


class CommContext:
    """Streams, events and in-flight buffers shared by every group under one root.

    ``inline`` is True on the CPU (and any device without streams): then the
    stream and event methods are no-ops and collectives complete in order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.inline = device.type in ("cpu", "meta") or not hasattr(getattr(torch, device.type, None), "Stream")
        # groups in the order their post-forward ran (with repeats): the
        # default backward prefetch target of group i is entry i - 1
        self.post_forward_order: list[Any] = []
        # (event, keep-alive) pairs of reduce-scatters still running on their stream
        self.pending_reduces: list[tuple[Any, Any]] = []
        self._streams: dict[str, Any] = {}  # "all_gather", "reduce_scatter"; made on first use

    def _stream(self, name: str) -> Any:
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = getattr(torch, self.device.type).Stream(priority=-1)
        return stream

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
        stream = self._stream(name)
        stream.wait_stream(handle.current_stream())
        with handle.stream(stream):
            yield

    def record(self, name: str | None = None) -> Any:
        """An event on stream ``name`` (or the current stream); None inline."""
        if self.inline:
            return None
        handle = getattr(torch, self.device.type)
        stream = self._stream(name) if name else handle.current_stream()
        event = handle.Event()
        event.record(stream)
        return event

    def current_waits(self, event: Any) -> None:
        """Make the current stream wait for ``event`` (no-op inline)."""
        if event is not None and not self.inline:
            getattr(torch, self.device.type).current_stream().wait_event(event)

    def stream_waits(self, name: str, event: Any) -> None:
        if event is not None and not self.inline:
            self._stream(name).wait_event(event)

    # ------------------------------------------------------- reduce buffers

    def hold_until_done(self, event: Any, keep_alive: Any) -> None:
        """Keep ``keep_alive`` (a reduce-scatter input made on the current
        stream and read on another) referenced until the current stream has waited on
        ``event``: at the next group's reduction or at the end of backward, so
        at most one group's reduction buffers are in flight."""
        if not self.inline:
            self.pending_reduces.append((event, keep_alive))

    def wait_for_reduces(self, keep: int = 0) -> None:
        """Wait for the oldest reductions until at most ``keep`` are in flight
        (``set_reduce_scatter_max_input_buffers(k)`` keeps ``k - 1`` before a
        group adds its own)."""
        while len(self.pending_reduces) > keep:
            event, _ = self.pending_reduces.pop(0)
            self.current_waits(event)
