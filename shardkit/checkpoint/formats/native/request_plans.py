"""What one read request takes from its stored chunk, worked out once.

A load shows the native reader each request several times: ``prepare``
validates it and checks its data file, ``verify`` (the checking pass) and
``read`` fetch its bytes, and reading asks again on each path -- the kernel
hint, the choice between a direct and a staged read, the grouping of remote
ranges.  Every one of them needs the same facts: the chunk record the request
names, the byte runs of its box inside the chunk, and those runs widened to
whole checksum blocks (what is fetched, so it can be verified).  Computing
them per use cost a validation and a vectorised ``byte_runs`` each time, for
every request of a load of thousands of small tensors.  A :class:`RequestPlan`
holds them; the reader computes it the first time it sees a request and keeps
it under what the request reads (key, chunk, box), so a copy of the request
with another ``out`` (host staging, a GPU target's page-locked rounds) uses
the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.checkpoint.formats.base import ReadRequest
from shardkit.checkpoint.formats.native.manifest import ChunkRecord
from shardkit.checkpoint.geometry.boxes import Box
from shardkit.checkpoint.geometry.plan import byte_runs

__all__ = ["RequestPlan", "checked_span", "plan_request", "batches", "MAX_GAP", "MAX_BATCH"]

MAX_GAP = 256 << 10  # remote reads: neighbouring spans at most this far apart share one ranged request
MAX_BATCH = 16 << 20  # ... of at most this many bytes


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """Where a request's bytes are: its chunk ``record``, the chunk-local span ``[lo, hi)`` to fetch (its
    byte runs widened to whole checksum blocks; a zstd frame whole), and ``run``, the one contiguous
    byte run of a raw chunk it needs when there is exactly one (a direct read's range), else ``None``."""

    record: ChunkRecord
    lo: int
    hi: int
    run: tuple[int, int] | None


def checked_span(rec: ChunkRecord, a: int, b: int) -> tuple[int, int]:
    """Bytes ``[a, b)`` of chunk ``rec`` rounded out to its checksum blocks: the bytes read to check them
    (every read of a chunk's bytes asks for these, and a rerun's plan of reads for the same)."""
    return a // rec.block * rec.block, min(rec.nbytes, -(-b // rec.block) * rec.block)


def plan_request(record: ChunkRecord, box: Box, itemsize: int) -> RequestPlan:
    """The plan of reading ``box`` (global coordinates, inside ``record``'s box) of items of ``itemsize``."""
    if record.codec == "zstd":
        return RequestPlan(record, 0, record.nbytes, None)
    runs = byte_runs(record.box, box, itemsize)
    first, last = int(runs[0, 0]), int(runs[-1, 1])
    lo, hi = checked_span(record, first, last)
    return RequestPlan(record, lo, hi, (first, int(runs[0, 1])) if len(runs) == 1 else None)


def batches(items: list[tuple[ReadRequest, RequestPlan]]) -> list[list[tuple[ReadRequest, RequestPlan]]]:
    """Group pieces of the same file whose spans nearly touch (gap <= ``MAX_GAP``, batch <= ``MAX_BATCH``)."""
    items = sorted(items, key=lambda it: (it[1].record.file, it[1].record.start + it[1].lo))
    out: list[list[tuple[ReadRequest, RequestPlan]]] = []
    end = -1
    for it in items:
        plan = it[1]
        a, b = plan.record.start + plan.lo, plan.record.start + plan.hi
        cur = out[-1] if out else None
        if (cur is not None and cur[0][1].record.file == plan.record.file and a - end <= MAX_GAP
                and b - (cur[0][1].record.start + cur[0][1].lo) <= MAX_BATCH):
            cur.append(it)
            end = max(end, b)
        else:
            out.append([it])
            end = b
    return out
