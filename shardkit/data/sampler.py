"""``ElasticSampler``: one global batch sequence, cut into per-rank shares.

Why global: a resumed job may run on another number of ranks.  If each rank
had its own sample order (as with ``DistributedSampler``), "where we were"
would be a per-rank fact with no meaning at the new world size.  Here the
sequence of **global** batches is a function of ``(num_samples,
global_batch_size, seed, epoch)`` only; a rank's share of step ``k`` is a
contiguous slice of global batch ``k``.  The position is therefore two
integers -- the epoch and how many global batches of it the training loop has
received -- and it means the same at every world size.

Why "received": with ``num_workers > 0`` a ``DataLoader`` pulls index lists
from its batch sampler ahead of the loop (``prefetch_factor * num_workers``
of them), so how far the sampler's iterator ran is not how far training got.
:class:`shardkit.data.ElasticLoader` (a ``DataLoader``) counts the batches it
yields to the loop and reports each through :meth:`ElasticSampler.advance`.
Without such a loader the sampler counts the shares it hands out itself, which
is exact only when nothing prefetches (direct iteration, or a plain
``DataLoader`` with ``num_workers=0``); a plain ``DataLoader`` with workers is
detected and makes :meth:`~ElasticSampler.state_dict` raise instead of
returning a position ahead of the truth.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Iterator

import torch

from shardkit.errors import ConfigurationError, DataStateError
from shardkit.wire.collectives import rank_world

__all__ = ["ElasticSampler", "share_bounds"]

log = logging.getLogger("shardkit.data.sampler")

# The fields that define the global batch sequence: a saved position is only
# meaningful for a sampler that agrees on all of them.
_SEQUENCE_FIELDS = ("num_samples", "global_batch_size", "seed", "shuffle", "drop_last")


def share_bounds(batch_len: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s contiguous share of a global batch of ``batch_len``.

    The split is ``torch.tensor_split``'s: every rank gets ``batch_len //
    world_size`` samples and the first ``batch_len % world_size`` ranks one
    more, so 8 samples over 3 ranks are 3, 3, 2 and a last partial batch of
    2 over 4 ranks is 1, 1, 0, 0 (an empty share).
    """
    base, extra = divmod(batch_len, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _int_arg(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"ElasticSampler: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _prefetching_dataloader_caller() -> bool:
    """Whether ``iter(sampler)`` was called by a ``DataLoader`` iterator with worker processes.

    A best-effort guard, not the mechanism: torch's iterator calls
    ``iter(self._index_sampler)`` from its own method, so the caller's
    ``self`` tells its worker count.  If torch changes shape this returns
    ``False`` and nothing else changes.
    """
    try:
        frame = sys._getframe(2)  # 0: here, 1: ElasticSampler.__iter__, 2: its caller
    except ValueError:
        return False
    owner = frame.f_locals.get("self")
    if owner is None or not type(owner).__module__.startswith("torch.utils.data"):
        return False
    return int(getattr(owner, "_num_workers", 0) or 0) > 0


class ElasticSampler:
    """A batch sampler whose global batch sequence does not depend on the world size.

    Use it as ``batch_sampler=`` of :class:`shardkit.data.ElasticLoader`
    (a ``DataLoader`` that counts what the loop received), or of a plain
    ``DataLoader`` with ``num_workers=0``::

        sampler = ElasticSampler(len(dataset), global_batch_size=256, seed=0)
        loader = ElasticLoader(dataset, batch_sampler=sampler, num_workers=4)
        for epoch in range(sampler.epoch, epochs):
            for batch in loader:        # resumes mid-epoch after load_state_dict
                ...

    Epoch ``e`` shuffles with ``torch.randperm(num_samples)`` drawn from a
    private generator seeded ``seed + e`` (the global RNG is never touched);
    without ``shuffle`` the order is ``0..num_samples-1``.  ``drop_last``
    drops the last partial global batch; otherwise it is the epoch's last step
    and is split like any other (some ranks may get an empty share ``[]``).
    ``drop_last`` defaults to ``True``, unlike torch's ``DistributedSampler``
    and ``BatchSampler`` (``False``): every step then trains on a full global
    batch, so the loss scale and a per-step schedule mean the same at every
    world size.  Pass ``drop_last=False`` to keep the partial batch; a saved
    position resumes only with the same ``drop_last``.
    Every rank yields the same number of shares per epoch, so collectives in
    the step stay matched.  After the last global batch of an epoch is
    received the position moves to the start of the next epoch by itself.
    """

    def __init__(self, num_samples: int, *, global_batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, rank: int | None = None, world_size: int | None = None) -> None:
        self.num_samples = _int_arg("num_samples", num_samples, 1)
        self.global_batch_size = _int_arg("global_batch_size", global_batch_size, 1)
        self.seed = _int_arg("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        default_rank, default_world = rank_world() if rank is None or world_size is None else (0, 1)
        self.world_size = _int_arg("world_size", default_world if world_size is None else world_size, 1)
        self.rank = _int_arg("rank", default_rank if rank is None else rank, 0)
        if self.rank >= self.world_size:
            raise ConfigurationError(f"ElasticSampler: rank {self.rank} is not below world_size {self.world_size}")
        full, partial = divmod(self.num_samples, self.global_batch_size)
        self.batches_per_epoch = full + (1 if partial and not self.drop_last else 0)
        if self.batches_per_epoch == 0:
            raise ConfigurationError(
                f"ElasticSampler: {self.num_samples} samples make no global batch of {self.global_batch_size} "
                f"with drop_last=True; lower global_batch_size or pass drop_last=False")
        self._epoch = 0
        self._batches = 0          # global batches of self._epoch the loop has received
        self._pass = 0             # id of the newest iteration; older ones may not count
        self._counted_by_loader = False
        self._unknown_reason: str | None = None
        self._perm_cache: tuple[int, torch.Tensor] | None = None

    # ------------------------------------------------------------------ the sequence

    def permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch`` (int64), the same on every rank and at every world size."""
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1]
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_samples, generator=generator, dtype=torch.int64)
        else:
            perm = torch.arange(self.num_samples, dtype=torch.int64)
        self._perm_cache = (epoch, perm)
        return perm

    def global_batch(self, epoch: int, index: int) -> list[int]:
        """Sample indices of global batch ``index`` of ``epoch`` (what all ranks' shares make together)."""
        if not 0 <= index < self.batches_per_epoch:
            raise IndexError(f"global batch {index} of an epoch with {self.batches_per_epoch}")
        start = index * self.global_batch_size
        return self.permutation(epoch)[start:start + self.global_batch_size].tolist()

    def share(self, epoch: int, index: int) -> list[int]:
        """This rank's contiguous part of global batch ``index`` of ``epoch`` (see :func:`share_bounds`)."""
        batch = self.global_batch(epoch, index)
        lo, hi = share_bounds(len(batch), self.rank, self.world_size)
        return batch[lo:hi]

    def __len__(self) -> int:
        """Steps per epoch (every rank takes the same number), not what is left of the current one."""
        return self.batches_per_epoch

    # ------------------------------------------------------------------ position

    @property
    def epoch(self) -> int:
        """The epoch the next global batch belongs to."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Global batches of :attr:`epoch` the training loop has received."""
        return self._batches

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch``; a no-op when ``epoch`` is already the current one.

        For loops written for ``DistributedSampler`` (``sampler.set_epoch(e)``
        each epoch): the position moves to the next epoch by itself, so
        calling this with :attr:`epoch` keeps a resumed mid-epoch position.
        """
        epoch = _int_arg("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._batches = epoch, 0
            self._pass += 1

    def start_pass(self) -> int:
        """Begin a new iteration over the rest of the epoch; return its id for :meth:`advance`.

        Called by a loader that counts consumption itself (``ElasticLoader``);
        any older iteration still alive stops counting, so a forgotten
        iterator cannot move the position.
        """
        self._pass += 1
        return self._pass

    def advance(self, pass_id: int) -> None:
        """Record that the training loop received one more global batch (its share of it).

        ``pass_id`` is what :meth:`start_pass` returned for the iteration the
        batch came from; a batch from an older iteration (one replaced by a
        newer ``iter()``, ``load_state_dict`` or ``set_epoch``) raises instead
        of counting twice.
        """
        if pass_id != self._pass:
            raise DataStateError(
                "ElasticSampler: a batch arrived from an iteration that a newer iter(), load_state_dict() or "
                "set_epoch() replaced; iterate the newest iterator only")
        self._batches += 1
        if self._batches == self.batches_per_epoch:
            self._epoch, self._batches = self._epoch + 1, 0

    def count_consumption_externally(self) -> None:
        """Let a loader report consumption through :meth:`advance` instead of counting hand-outs.

        ``ElasticLoader`` calls this once when it is built around the sampler.
        """
        self._counted_by_loader = True

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's shares of the remaining global batches of the current epoch."""
        if not self._counted_by_loader:
            if _prefetching_dataloader_caller():
                self._unknown_reason = (
                    "a plain torch DataLoader with num_workers > 0 drives this ElasticSampler, and it prefetches "
                    "batches the training loop has not received yet; build the loader with "
                    "shardkit.data.ElasticLoader(dataset, batch_sampler=sampler, ...) so the saved position "
                    "counts what the loop received")
                log.warning("%s", self._unknown_reason)
            pass_id = self.start_pass()
        else:
            pass_id = self._pass
        return self._shares(self._epoch, self._batches, pass_id)

    def _shares(self, epoch: int, first: int, pass_id: int) -> Iterator[list[int]]:
        for index in range(first, self.batches_per_epoch):
            share = self.share(epoch, index)
            if not self._counted_by_loader:
                self.advance(pass_id)  # counted when handed out: exact only without prefetching
            yield share

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The global position, plain JSON ints and bools; the same on every rank.

        ``epoch`` and ``batches`` (global batches of that epoch received by
        the loop) are the position; the other fields define the sequence and
        are checked on load.  Raises :class:`DataStateError` when the position
        is unknown (a plain ``DataLoader`` with workers drove the sampler).
        """
        if self._unknown_reason is not None:
            raise DataStateError(f"ElasticSampler cannot say where training is: {self._unknown_reason}")
        return {"epoch": self._epoch, "batches": self._batches,
                **{name: getattr(self, name) for name in _SEQUENCE_FIELDS}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved global position, whatever world size saved it.

        The next share this rank yields is its part of exactly the next global
        batch the saving run would have produced.  Refuses a position saved
        for another sequence (dataset size, batch size, seed, shuffle,
        drop_last) with :class:`DataStateError` naming the field.
        """
        self.check_state_dict(state)
        self._epoch, self._batches = state["epoch"], state["batches"]
        self._unknown_reason = None
        self._pass += 1

    def check_state_dict(self, state: Any) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state``, changing nothing.

        A checkpoint load asks this before it writes any model or optimizer
        tensor, so a sampler built for another sequence fails the resume
        while the run is still as it was.
        """
        if not isinstance(state, dict):
            raise DataStateError(f"ElasticSampler.load_state_dict needs a dict, got {type(state).__name__}")
        missing = [k for k in ("epoch", "batches", *_SEQUENCE_FIELDS) if k not in state]
        if missing:
            raise DataStateError(f"ElasticSampler state lacks {', '.join(missing)}; it was not written by "
                                 f"ElasticSampler.state_dict()")
        for name in _SEQUENCE_FIELDS:
            if state[name] != getattr(self, name):
                raise DataStateError(
                    f"ElasticSampler: the saved position is for {name}={state[name]!r} but this sampler has "
                    f"{name}={getattr(self, name)!r}, so its global batches differ; build the sampler with the "
                    f"saved {name} to resume")
        epoch, batches = state["epoch"], state["batches"]
        if not (isinstance(epoch, int) and isinstance(batches, int) and epoch >= 0
                and 0 <= batches < self.batches_per_epoch):
            raise DataStateError(f"ElasticSampler: saved position epoch={epoch!r}, batches={batches!r} is out of "
                                 f"range for {self.batches_per_epoch} global batches per epoch")

    def __repr__(self) -> str:
        return (f"ElasticSampler(num_samples={self.num_samples}, global_batch_size={self.global_batch_size}, "
                f"seed={self.seed}, shuffle={self.shuffle}, drop_last={self.drop_last}, rank={self.rank}, "
                f"world_size={self.world_size}, epoch={self._epoch}, batches={self._batches})")
