"""The collectives that carry JSON and bytes instead of pickle, and the any-failed agreement.

``torch.distributed``'s ``*_object`` collectives pickle their payload; shardkit
never unpickles anything, so what ranks exchange travels as ``uint8`` tensors:
a fixed-size first transfer per rank holding its length and as much of its
payload as fits (:func:`frame_bytes`), and, only for payloads that did not fit,
the rest in a second one (the gathers need equal-sized buffers).  Every function takes an explicit
``group`` (the default group when ``None``) and is the identity without a
process group or in a group of one, so callers run unchanged in one process.
Each waits for its collective through :func:`~shardkit.wire.arrival.complete`,
so a caller that watches the collective (a checkpoint's, with a deadline) is
released when another rank gives up on it.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import torch

from shardkit.errors import error_record, from_record
from shardkit.wire.arrival import complete

__all__ = ["rank_world", "group_device", "frame_bytes", "framed", "frame_length", "unframed", "all_gather_bytes",
           "all_gather_json",
           "encode_json", "decode_json", "any_failed", "raise_any_failure"]


def _distributed() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_world(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (the default group when ``None``), or ``(0, 1)`` without one."""
    dist = _distributed()
    if dist is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def group_device(group: Any = None) -> torch.device:
    """Where ``group``'s tensors must live: the current CUDA device under NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def frame_bytes(world: int) -> int:
    """How many bytes each rank sends in the first transfer of a gather over ``world`` ranks: its payload's
    length (8 bytes) and as much of the payload as fits.  Most of what ranks exchange (decisions, counts, a
    small save's chunk records) fits, so a gather is one transfer, not the lengths first and then the bytes;
    what gathers to one rank stays under 4 MiB however many ranks there are."""
    return max(256, min(64 << 10, (4 << 20) // max(world, 1))) // 8 * 8


def framed(payload: torch.Tensor, frame: int, device: torch.device) -> torch.Tensor:
    """``payload`` (``uint8``) as the first transfer of a gather: its length, then its first bytes, on ``device``."""
    out = torch.zeros(frame, dtype=torch.uint8, device=device)
    out[:8].view(torch.int64)[0] = payload.numel()
    head = payload[:frame - 8]
    if head.numel():
        out[8:8 + head.numel()] = head.to(device)
    return out


def frame_length(frame: torch.Tensor) -> int:
    """The payload length a :func:`framed` transfer announces."""
    return int(frame[:8].view(torch.int64)[0])


def unframed(frame: torch.Tensor, rest: torch.Tensor | None) -> torch.Tensor:
    """The payload a :func:`framed` transfer began, completed by ``rest`` (what did not fit) where needed."""
    size = frame_length(frame)
    head = frame[8:8 + min(size, frame.numel() - 8)]
    return head if rest is None or size <= frame.numel() - 8 else torch.cat([head, rest[:size - head.numel()]])


def all_gather_bytes(payload: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``payload`` (a flat ``uint8`` tensor), indexed by rank in ``group``.

    One all-gather of :func:`framed` transfers; a second one, of what did not fit (padded to the longest),
    only when a payload was too long -- every rank knows every length after the first, so all agree on it.
    Without a process group, or in a group of one, it returns ``[payload]`` itself.  The gathered payloads
    live on the group's device.
    """
    _, world = rank_world(group)
    if world == 1:
        return [payload]
    import torch.distributed as dist

    device, size = group_device(group), frame_bytes(world)
    frames = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(world)]
    complete(dist.all_gather(frames, framed(payload, size, device), group=group, async_op=True))
    longest = max(frame_length(f) for f in frames) - (size - 8)
    if longest <= 0:
        return [unframed(f, None) for f in frames]
    rest = torch.zeros(longest, dtype=torch.uint8, device=device)
    own = payload[size - 8:]
    if own.numel():
        rest[:own.numel()] = own.to(device)
    rests = [torch.empty_like(rest) for _ in range(world)]
    complete(dist.all_gather(rests, rest, group=group, async_op=True))
    return [unframed(f, r) for f, r in zip(frames, rests)]


def encode_json(obj: Any) -> torch.Tensor:
    """``obj`` as compact UTF-8 JSON in a ``uint8`` tensor."""
    return torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode("utf-8")), dtype=torch.uint8)


def decode_json(payload: torch.Tensor) -> Any:
    """The JSON value a ``uint8`` tensor spells (the inverse of what the gathers send)."""
    return json.loads(bytes(payload.cpu().numpy()).decode("utf-8"))


def all_gather_json(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-serialisable), indexed by rank in ``group``; ``[obj]`` itself without one."""
    _, world = rank_world(group)
    if world == 1:
        return [obj]
    return [decode_json(p) for p in all_gather_bytes(encode_json(obj), group)]


def any_failed(failed: bool, group: Any = None) -> bool:
    """True on every rank of ``group`` when ``failed`` is true on any of them (one small all-reduce).

    Why every rank must call it, even one that failed: the others would
    otherwise wait in their next collective until the group times out.
    """
    _, world = rank_world(group)
    if world == 1:
        return failed
    import torch.distributed as dist

    flag = torch.tensor([1 if failed else 0], dtype=torch.int64, device=group_device(group))
    complete(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True))
    return bool(flag.item())


def raise_any_failure(first_error: Callable[[Any], tuple[int, Any] | None], own: BaseException | None,
                      message: Callable[[int, str], str] | None = None) -> None:
    """Raise on every rank when any rank failed; return on every rank when none did.

    ``first_error`` is the group's agreement on the lowest failing rank (e.g.
    :meth:`~shardkit.checkpoint.io.dist.Dist.first_error`); it is handed this rank's
    :func:`~shardkit.errors.error_record` of ``own`` (``None``: this rank did not fail).  A rank
    that failed re-raises its own exception, type and traceback intact; the others raise the first
    failing rank's error rebuilt by :func:`~shardkit.errors.from_record`, its text
    ``message(rank, its message)`` when given, so the error says which rank failed.
    """
    first = first_error(None if own is None else error_record(own))
    if first is None:
        return
    if own is not None:
        raise own
    rank, record = first
    raise from_record(record, None if message is None else message(rank, str(record["message"])))
