"""Reads into accelerator targets: through two small page-locked host buffers, never a host copy of the state.

A reader fills host memory (``preadv`` or a ranged fetch lands in RAM), so a
GPU target needs its bytes staged on the host first.  Staging a whole rank's
state there would double its memory on the host and copy from pageable
memory, which runs a fraction of the bus's speed.  Instead the requests
aimed at device memory are read in rounds of at most ``ROUND_BYTES`` into one
of two page-locked buffers, and each round is copied to the device
asynchronously while the next one is read into the other buffer; a buffer is
reused only once the copies out of it have finished (an event per round).
Host memory stays at two rounds whatever the state's size (a round holds one
request at least: a foreign format's chunk bigger than a round is one round).
"""

from __future__ import annotations

from typing import Sequence

import torch

from shardkit.checkpoint.formats.base import CheckpointReader, ReadRequest
from shardkit.checkpoint.io.rounds import ROUND_BYTES, aligned, nbytes_of

__all__ = ["read_requests"]


def read_requests(reader: CheckpointReader, requests: Sequence[ReadRequest], round_bytes: int = ROUND_BYTES) -> None:
    """``reader.read(requests)``, where requests whose ``out`` is device memory go through host rounds."""
    host = [r for r in requests if r.out.device.type == "cpu"]
    device = [r for r in requests if r.out.device.type != "cpu" and r.out.numel()]
    if host:
        reader.read(host)
    if not device:
        return
    rounds: list[list[ReadRequest]] = [[]]
    filled = 0
    for r in device:
        size = aligned(nbytes_of(r.out))
        if rounds[-1] and filled + size > round_bytes:
            rounds.append([])
            filled = 0
        rounds[-1].append(r)
        filled += size
    pinned = torch.cuda.is_available() and all(r.out.is_cuda for r in device)
    longest = max(sum(aligned(nbytes_of(r.out)) for r in batch) for batch in rounds)
    buffers = [torch.empty(longest, dtype=torch.uint8, pin_memory=pinned) for _ in range(min(2, len(rounds)))]
    copied: list = [None] * len(buffers)
    for i, batch in enumerate(rounds):
        slot = i % len(buffers)
        if copied[slot] is not None:
            copied[slot].synchronize()  # the device has what this buffer held before
        staged, pos = [], 0
        for r in batch:
            nbytes = nbytes_of(r.out)
            staged.append(buffers[slot][pos:pos + nbytes].view(r.out.dtype).view(r.out.shape))
            pos += aligned(nbytes)
        reader.read([ReadRequest(r.fqn, r.chunk, r.box, buf) for r, buf in zip(batch, staged)])
        for r, buf in zip(batch, staged):
            r.out.copy_(buf, non_blocking=pinned)
        copied[slot] = _record(r.out.device) if pinned else None
    for event in copied:
        if event is not None:
            event.synchronize()


def _record(device: torch.device):
    """An event after the copies just queued on ``device``'s current stream."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
