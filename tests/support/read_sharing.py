"""Loads that share every read several ranks need, however few its bytes.

A local load reads shared bytes on every rank that needs them when they add up
to less than ``shared_reads.REREAD_BELOW`` (a few scalars cost less to read
again than to send); tests of the exchange itself use tiny tensors, so they
turn that off for the load they run, in the rank, and put it back after: the
pool's ranks serve the next test as they were.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["sharing_every_read"]


@contextlib.contextmanager
def sharing_every_read() -> Iterator[None]:
    from shardkit.checkpoint.training import shared_reads

    before, shared_reads.REREAD_BELOW = shared_reads.REREAD_BELOW, 0
    try:
        yield
    finally:
        shared_reads.REREAD_BELOW = before
