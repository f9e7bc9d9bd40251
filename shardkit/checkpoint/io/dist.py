"""The few collectives a checkpoint needs, carrying JSON instead of pickle, for one process group.

``torch.distributed``'s ``*_object`` collectives pickle their payload; shardkit
never unpickles anything, so metadata travels as UTF-8 JSON in ``uint8``
tensors (:mod:`shardkit.wire.collectives` holds the gather and the any-failed
agreement that ``data/`` uses too).  Every helper works without a process group too (then it is the
identity), so ``save``/``load`` run unchanged in a single process.

All helpers take an explicit ``group``.  The background writer of
``async_save`` passes its own gloo group: gloo aborts when two threads issue
collectives on one group concurrently, so the training thread keeps the
default group to itself.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardkit.errors import error_record, from_record
from shardkit.wire.collectives import (
    all_gather_json,
    any_failed,
    decode_json,
    encode_json,
    group_device,
    pad_to_longest,
)

__all__ = ["Dist"]


class _ThisRankAlone:
    """The stand-in group of work one rank does by itself while a process group exists (the hot tier's
    per-rank copies): collectives over it are the identity, and caches keyed by group keep it apart."""


_THIS_RANK_ALONE = _ThisRankAlone()


class Dist:
    """Rank, world size and a process group (``None`` when running without one)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group
        if self.enabled:
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            self.group_rank = dist.get_rank(group) if group is not None else self.rank
            self.group_size = dist.get_world_size(group) if group is not None else self.world_size
        else:
            self.rank, self.world_size, self.group_rank, self.group_size = 0, 1, 0, 1

    @classmethod
    def alone(cls) -> "Dist":
        """This rank by itself: its real rank and world size (data files are named by rank), but a group of
        one, so ``save``'s planning, writing and commit run with no collective at all."""
        solo = cls()
        solo.group, solo.group_rank, solo.group_size = _THIS_RANK_ALONE, 0, 1
        return solo

    @property
    def active(self) -> bool:
        return self.enabled and self.group_size > 1

    def device(self) -> torch.device:
        """Where this group's tensors must live: the current CUDA device under NCCL, else the CPU."""
        return group_device(self.group)

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-serialisable), in group-rank order."""
        if not self.active:
            return [obj]
        return all_gather_json(obj, self.group)

    def broadcast_json(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of group rank ``src`` on every rank."""
        if not self.active:
            return obj
        import torch.distributed as dist

        dev = self.device()
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        data = encode_json(obj) if self.group_rank == src else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
        dist.broadcast(size, src_global, group=self.group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
        if self.group_rank == src and data.numel():
            buf.copy_(data)
        if buf.numel():
            dist.broadcast(buf, src_global, group=self.group)
        return decode_json(buf)

    def gather_json(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on group rank ``dst`` (in group-rank order); ``None`` elsewhere."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        buf, sizes = pad_to_longest(encode_json(obj), self.group, self.group_size, self.device())
        dev, longest = buf.device, buf.numel()
        dst_global = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        bufs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(self.group_size)] \
            if self.group_rank == dst else None
        dist.gather(buf, bufs, dst=dst_global, group=self.group)
        if bufs is None:
            return None
        return [decode_json(b[:int(s.item())]) for b, s in zip(bufs, sizes)]

    def decided_on_rank0(self, decide: Callable[[], Any], where: str) -> Any:
        """``decide()`` (a JSON value) run on group rank 0 and its answer on every rank.  A failure there is
        raised on every rank -- as it was on rank 0, as the same shardkit error class elsewhere, naming
        ``where`` -- instead of leaving the others waiting in the broadcast until the group times out."""
        answer, failure = None, None
        if self.group_rank == 0:
            try:
                answer = {"value": decide()}
            except Exception as exc:  # noqa: BLE001 - sent to every rank, then re-raised as it was
                failure, answer = exc, {"error": error_record(exc)}
        answer = self.broadcast_json(answer)
        if failure is not None:
            raise failure
        if "error" in answer:
            raise from_record(answer["error"], f"rank 0 failed under {where}: {answer['error']['message']}")
        return answer["value"]

    def first_error(self, message: Any) -> tuple[int, Any] | None:
        """``(rank, message)`` of the lowest rank that reported an error (any JSON value, e.g. an
        :func:`~shardkit.errors.error_record`), on every rank; else ``None``."""
        if not self.active:
            return (self.rank, message) if message is not None else None
        if not self.any_failed(message is not None):
            return None
        for rank, msg in enumerate(self.all_gather_json(message)):
            if msg is not None:
                return rank, msg
        return None  # pragma: no cover

    def any_failed(self, failed: bool) -> bool:
        """True on every rank when ``failed`` is true on any rank."""
        if not self.active:
            return failed
        return any_failed(failed, self.group)

    def all_same(self, ok: bool, value: int) -> bool:
        """True on every rank when ``ok`` holds on every rank and every rank passed the same ``value``
        (one small all-reduce)."""
        return self.start_all_same(ok, value)()

    def start_all_same(self, ok: bool, value: int) -> Callable[[], bool]:
        """:meth:`all_same` started in the background; call the result for the answer (every rank must),
        so local work -- a copy the answer may let stand -- overlaps the all-reduce and the other ranks' lag."""
        if not self.active:
            return lambda: ok
        import torch.distributed as dist

        flags = torch.tensor([0 if ok else 1, value, -value], dtype=torch.int64, device=self.device())
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

        def answer() -> bool:
            work.wait()
            return int(flags[0]) == 0 and int(flags[1]) == -int(flags[2])
        return answer

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier(group=self.group)

