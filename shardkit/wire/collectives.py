"""The collectives that carry JSON and bytes instead of pickle, and the any-failed agreement.

``torch.distributed``'s ``*_object`` collectives pickle their payload; shardkit
never unpickles anything, so what ranks exchange travels as ``uint8`` tensors:
each rank's length first, then every payload zero-padded to the longest (the
gathers need equal-sized buffers).  Every function takes an explicit
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

__all__ = ["rank_world", "group_device", "pad_to_longest", "all_gather_bytes", "all_gather_json",
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


def pad_to_longest(payload: torch.Tensor, group: Any, world: int,
                   device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``payload`` (``uint8``) on ``device``, zero-padded to the longest of any rank's, and every rank's length.

    Collective over ``group`` (``world`` ranks): the lengths travel first.
    """
    import torch.distributed as dist

    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    complete(dist.all_gather(sizes, size, group=group, async_op=True))
    padded = torch.zeros(max(int(s.item()) for s in sizes), dtype=torch.uint8, device=device)
    if payload.numel():
        padded[:payload.numel()] = payload.to(device)
    return padded, sizes


def all_gather_bytes(payload: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``payload`` (a flat ``uint8`` tensor), indexed by rank in ``group``.

    Without a process group, or in a group of one, it returns ``[payload]``
    itself.  The gathered payloads live on the group's device.
    """
    _, world = rank_world(group)
    if world == 1:
        return [payload]
    import torch.distributed as dist

    padded, sizes = pad_to_longest(payload, group, world, group_device(group))
    gathered = [torch.empty_like(padded) for _ in range(world)]
    complete(dist.all_gather(gathered, padded, group=group, async_op=True))
    return [g[:int(s.item())] for g, s in zip(gathered, sizes)]


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
