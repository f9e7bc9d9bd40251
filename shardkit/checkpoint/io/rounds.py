"""The sizes every staged byte shares: the round a transfer or a device read moves at once, the alignment
of a slot in a buffer, and a tensor's size in bytes.

Loads and saves move bytes through buffers that are sliced into slots, one
round at a time (a load's GPU reads and shared reads, the hot tier's
directory moves, ``async_save``'s staging).  They agree on one round size,
so the memory a transfer may hold is stated once, and on one slot alignment:
64 bytes, a multiple of every dtype's element size (so a slot can be viewed
as any dtype) and a cache line (so two slots never share one).
"""

from __future__ import annotations

import torch

__all__ = ["ROUND_BYTES", "ALIGNMENT", "aligned", "nbytes_of"]

ROUND_BYTES = 256 << 20
ALIGNMENT = 64


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGNMENT`: where the next slot after ``n`` bytes starts."""
    return -(-n // ALIGNMENT) * ALIGNMENT


def nbytes_of(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements (its view, not its storage)."""
    return t.numel() * t.element_size()
