"""The few collectives a checkpoint needs, carrying JSON instead of pickle, for one process group.

``torch.distributed``'s ``*_object`` collectives pickle their payload; shardkit
never unpickles anything, so metadata travels as UTF-8 JSON in ``uint8``
tensors (:mod:`shardkit.wire.collectives` holds the gather and the any-failed
agreement that ``data/`` uses too).  Every helper works without a process group too (then it is the
identity), so ``save``/``load`` run unchanged in a single process.

Every collective has a deadline: the ranks first check in at the job's store
(:mod:`shardkit.wire.arrival`) within the timeout of the operation they are
part of (:mod:`~shardkit.checkpoint.io.deadline`), so a rank that died, froze or
never called fails the others with :class:`~shardkit.errors.CheckpointTimeout`
naming it and the ``phase`` (plan, write, commit, replicate, vote, read),
instead of holding them in the collective; a rank that dies inside the
collective itself fails them with :class:`~shardkit.errors.PeerLost`.

All helpers take an explicit ``group``.  The background writer of
``async_save`` passes its own gloo group: gloo aborts when two threads issue
collectives on one group concurrently, so the training thread keeps the
default group to itself.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, TypeVar

import torch

from shardkit.checkpoint.io.deadline import Deadline, current_deadline, peer_lost_error, timeout_error
from shardkit.errors import ShardkitError, error_record, from_record
from shardkit.wire.arrival import arrive, complete, report_failure, roll_call, the_group, watched
from shardkit.wire.collectives import (
    all_gather_json,
    any_failed,
    decode_json,
    encode_json,
    frame_bytes,
    frame_length,
    framed,
    group_device,
    unframed,
)

__all__ = ["Dist"]

T = TypeVar("T")
_FRAME_BYTES = 4096  # what a broadcast sends in its first (and usually only) transfer, its length included
_ROLL_CALL_S = 2.0  # how long survivors of a failed collective wait for each other, to name who is gone
# A group whose collective a rank missed or left cannot be used again (the ranks' sequences parted): its
# error, raised again at once by any later collective, so code that goes on to the next one to report a
# local failure (as save does) fails at once instead of waiting out a second deadline.
_broken: weakref.WeakKeyDictionary[Any, ShardkitError] = weakref.WeakKeyDictionary()  # by group, held weakly


def _json_bytes(payload: torch.Tensor) -> bytes:
    return bytes(payload.cpu().numpy())


class _ThisRankAlone:
    """The stand-in group of work one rank does by itself while a process group exists (the hot tier's
    per-rank copies): collectives over it are the identity, and caches keyed by group keep it apart."""


_THIS_RANK_ALONE = _ThisRankAlone()


class Dist:
    """Rank, world size and a process group (``None`` when running without one).

    ``deadline``: the operation its collectives belong to (the enclosing
    :func:`~shardkit.checkpoint.io.deadline.checkpoint_deadline`'s by default); ``phase``: the label of the
    collectives that follow, set by the caller as the operation moves on (``dist.phase = "commit"``).
    """

    def __init__(self, group: Any = None, deadline: Deadline | None = None) -> None:
        import torch.distributed as dist

        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group
        self.deadline = deadline if deadline is not None else current_deadline()
        self.phase = "plan"
        # the largest ``most`` any rank passed to this operation's last agreement that held (every rank holds
        # the same value, so a later step may decide on it alike without asking again); None until one did
        self.agreed_most: int | None = None
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

    def arrive(self, phase: str | None = None) -> int:
        """Check in at the group's next collective and wait for every rank, within the deadline; raises
        :class:`~shardkit.errors.CheckpointTimeout` naming the ranks that did not arrive.  Every rank of the
        group calls it (each collective below does); a round of point-to-point transfers calls it first, on
        every rank, whether or not it sends or receives in that round.  Returns the collective's number."""
        phase = phase or self.phase
        earlier = _broken.get(the_group(self.group))
        if earlier is not None:
            raise type(earlier)(str(earlier))
        try:
            found = arrive(self.group, self.deadline.timeout_s)
        except RuntimeError as exc:  # the store itself is gone (its host died)
            raise self._broke(peer_lost_error(self.deadline, phase, (), exc)) from exc
        if found.failed_before is not None:  # another rank saw the last collective fail: name who is gone
            gone = roll_call(self.group, found.seq - 1, _ROLL_CALL_S)
            raise self._broke(peer_lost_error(self.deadline, phase, gone, RuntimeError(found.failed_before)))
        if found.missing:
            raise self._broke(timeout_error(self.deadline, phase, found.missing))
        return found.seq

    def _broke(self, error: ShardkitError) -> ShardkitError:
        _broken[the_group(self.group)] = error
        return error

    def collective(self, run: Callable[[], T], phase: str | None = None) -> T:
        """``run()`` (collectives over the group) once every rank has arrived; a rank that dies inside it fails
        the others with :class:`~shardkit.errors.PeerLost` (torch raises a bare ``RuntimeError``)."""
        phase = phase or self.phase
        return self._finish(self.arrive(phase), phase, run)

    def _finish(self, seq: int, phase: str, run: Callable[[], T]) -> T:
        try:
            with watched(self.group, seq, self.deadline.timeout_s):
                return run()
        except ShardkitError:
            raise
        except RuntimeError as exc:
            raise self._failed(seq, phase, exc) from exc

    def _failed(self, seq: int, phase: str, exc: RuntimeError) -> ShardkitError:
        """The error of collective ``seq``, which raised ``exc`` here (a peer died, or froze inside it)."""
        gone: tuple[int, ...] = ()
        try:  # ranks blocked on this one (not on the dead one) are released by the report
            report_failure(self.group, seq, f"rank {self.rank}: {str(exc).splitlines()[0] if str(exc) else exc!r}")
            gone = roll_call(self.group, seq, _ROLL_CALL_S)
        except RuntimeError:
            pass
        if "timed out" in str(exc).lower():  # the deadline ran out inside it: a peer froze after arriving
            return self._broke(timeout_error(self.deadline, phase, gone))
        return self._broke(peer_lost_error(self.deadline, phase, gone, exc))

    @contextlib.contextmanager
    def rounds(self, phase: str | None = None) -> Iterator[None]:
        """Rounds of point-to-point transfers (:meth:`exchange`): every rank of the group checks in once,
        before them (ranks take part in different numbers of rounds), and each transfer is waited for within
        the deadline; a peer that dies or freezes in them fails this rank as a collective would."""
        if not self.active:
            yield
            return
        phase = phase or self.phase
        seq = self.arrive(phase)
        try:
            with watched(self.group, seq, self.deadline.timeout_s):
                yield
        except ShardkitError:
            raise
        except RuntimeError as exc:
            raise self._failed(seq, phase, exc) from exc

    def exchange(self, ops: list[Any]) -> None:
        """One round of point-to-point transfers (``torch.distributed.P2POp``s); inside :meth:`rounds`."""
        if not ops:
            return
        import torch.distributed as dist

        for work in dist.batch_isend_irecv(ops):
            complete(work, pollable=False)

    def device(self) -> torch.device:
        """Where this group's tensors must live: the current CUDA device under NCCL, else the CPU."""
        return group_device(self.group)

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-serialisable), in group-rank order."""
        if not self.active:
            return [obj]
        return self.collective(lambda: all_gather_json(obj, self.group))

    def broadcast_json(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of group rank ``src`` on every rank."""
        if not self.active:
            return obj
        return self.collective(lambda: self._broadcast_json(obj, src))

    def _broadcast_json(self, obj: Any, src: int) -> Any:
        """One broadcast of a fixed frame -- the length, then as much of the JSON as fits -- and a second one
        only for what did not fit: every rank knows the frame's size, so a small answer (a commit's outcome, a
        decision) costs one collective, not a length and then the bytes."""
        import torch.distributed as dist

        dev = self.device()
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        data = encode_json(obj) if self.group_rank == src else torch.empty(0, dtype=torch.uint8)
        frame = framed(data, _FRAME_BYTES, dev)
        complete(dist.broadcast(frame, src_global, group=self.group, async_op=True))
        size = frame_length(frame)
        if size <= _FRAME_BYTES - 8:
            return decode_json(unframed(frame, None))
        rest = torch.empty(size - (_FRAME_BYTES - 8), dtype=torch.uint8, device=dev)
        if self.group_rank == src:
            rest.copy_(data[_FRAME_BYTES - 8:])
        complete(dist.broadcast(rest, src_global, group=self.group, async_op=True))
        return decode_json(unframed(frame, rest))

    def gather_json(self, obj: Any, dst: int = 0, *, encoded: bool = False) -> list[Any] | None:
        """Every rank's ``obj`` on group rank ``dst`` (in group-rank order); ``None`` elsewhere.

        ``encoded``: each as the UTF-8 JSON it travelled in (``bytes``), for a receiver that only passes the
        documents on -- decoding them would cost the training thread the GIL for nothing."""
        if not self.active:
            return [bytes(encode_json(obj).numpy())] if encoded else [obj]
        read = _json_bytes if encoded else decode_json
        return self.collective(lambda: self._gather_json(obj, dst, read))

    def _gather_json(self, obj: Any, dst: int, read: Callable[[torch.Tensor], Any]) -> list[Any] | None:
        """One gather of :func:`~shardkit.wire.collectives.framed` transfers (the length and what fits); a rank
        whose JSON did not fit sends the rest to ``dst`` point to point, and ``dst``, which read every length
        from the frames, receives exactly those -- no rank needs to know another's length, so a small gather
        (a save's reports) is one collective."""
        import torch.distributed as dist

        dev, size = self.device(), frame_bytes(self.group_size)
        data = encode_json(obj)
        dst_global = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        if not self.point_to_point_is_cheap:  # every rank pads to the longest instead (the lengths first)
            return self._gather_padded(data, dst_global, dst, read)
        frames = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(self.group_size)] \
            if self.group_rank == dst else None
        complete(dist.gather(framed(data, size, dev), frames, dst=dst_global, group=self.group, async_op=True))
        if frames is None:
            if data.numel() > size - 8:
                complete(dist.isend(data[size - 8:].to(dev), dst_global, group=self.group), pollable=False)
            return None
        rests: list[torch.Tensor | None] = [None] * self.group_size
        for rank, frame in enumerate(frames):
            if rank != self.group_rank and frame_length(frame) > size - 8:
                rests[rank] = torch.empty(frame_length(frame) - (size - 8), dtype=torch.uint8, device=dev)
                peer = dist.get_global_rank(self.group, rank) if self.group is not None else rank
                complete(dist.irecv(rests[rank], peer, group=self.group), pollable=False)
        rests[self.group_rank] = data[size - 8:].to(dev) if data.numel() > size - 8 else None
        return [read(unframed(f, r)) for f, r in zip(frames, rests)]

    @property
    def point_to_point_is_cheap(self) -> bool:
        """Whether a transfer between two ranks costs no more than a collective's: on gloo (the CPU); NCCL forms
        a communicator per pair on their first one."""
        return self.device().type == "cpu"

    def _gather_padded(self, data: torch.Tensor, dst_global: int, dst: int, read: Callable[[torch.Tensor], Any]
                       ) -> list[Any] | None:
        import torch.distributed as dist

        dev = self.device()
        lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(self.group_size)]
        complete(dist.all_gather(lengths, torch.tensor([data.numel()], dtype=torch.int64, device=dev),
                                 group=self.group, async_op=True))
        longest = max(int(n.item()) for n in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
        padded[:data.numel()] = data.to(dev)
        bufs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(self.group_size)] \
            if self.group_rank == dst else None
        complete(dist.gather(padded, bufs, dst=dst_global, group=self.group, async_op=True))
        return None if bufs is None else [read(b[:int(n.item())]) for b, n in zip(bufs, lengths)]

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
        return self.collective(lambda: any_failed(failed, self.group))

    def all_same(self, ok: bool, value: int, most: int | None = None) -> bool:
        """True on every rank when ``ok`` holds on every rank and every rank passed the same ``value``
        (one small all-reduce).  ``most``: see :meth:`start_all_same`."""
        return self.start_all_same(ok, value, most)()

    def start_all_same(self, ok: bool, value: int, most: int | None = None) -> Callable[[], bool]:
        """:meth:`all_same` started in the background; call the result for the answer (every rank must),
        so local work -- a copy the answer may let stand -- overlaps the all-reduce and the other ranks' lag.

        ``most`` (a count, every rank passing one or none alike) rides along in the same all-reduce: when the
        answer is true, :attr:`agreed_most` is the largest any rank passed -- e.g. the most chunks any rank of
        a save writes, from which every rank knows alike whether the save's records need index files."""
        if not self.active:
            self.agreed_most = most if ok else None
            return lambda: ok
        import torch.distributed as dist

        phase = self.phase
        seq = self.arrive(phase)
        flags = torch.tensor([0 if ok else 1, value, -value, -1 if most is None else most], dtype=torch.int64,
                             device=self.device())
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

        def answer() -> bool:
            self._finish(seq, phase, lambda: complete(work))
            same = int(flags[0]) == 0 and int(flags[1]) == -int(flags[2])
            self.agreed_most = int(flags[3]) if same and most is not None else None
            return same
        return answer

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            self.collective(lambda: complete(dist.barrier(group=self.group, async_op=True)))

