"""``ElasticLoader``: a ``DataLoader`` whose sampler position counts what the loop received.

Why a loader and not a call to remember: with ``num_workers > 0`` torch's
``DataLoader`` asks its batch sampler for index lists ahead of the training
loop, so only the loader sees when a batch actually reaches the loop.
``ElasticLoader`` is a ``DataLoader`` (a drop-in: same arguments, ``len``,
``isinstance``) whose iterator reports each batch it yields to the
:class:`~shardkit.data.ElasticSampler` before the loop body runs.  A
checkpoint taken inside the loop body therefore counts the batch being
trained on as consumed, and the resumed run starts with the next one --
however many batches the workers had prefetched.

Two more things a plain ``DataLoader`` gets wrong for exact resumption:

* Creating a ``DataLoader`` iterator draws the workers' base seed from
  ``generator=``, or from torch's **global** RNG when there is none, so a
  resumed run (which creates one iterator more than the original did at that
  point) would shift every later dropout mask.  ``ElasticLoader`` brings its
  own generator, seeded from ``(sampler.seed, epoch, position)`` at each
  iteration: the global RNG is untouched and worker seeds are reproducible.
* An empty share (uneven split of a small or last global batch) would make
  the default ``collate_fn`` fail on ``[]``; it reaches the loop as ``[]``
  instead, and the loop must still take part in the step's collectives.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from shardkit.data.sampler import ElasticSampler
from shardkit.errors import ConfigurationError

__all__ = ["ElasticLoader"]


class _EmptyShareCollate:
    """Pass an empty share through as ``[]``; collate everything else as asked.

    A class (not a closure) so that spawned worker processes can unpickle it.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        if len(samples) == 0:
            return []
        return self.collate_fn(samples)


def _worker_seed(seed: int, epoch: int, batches: int) -> int:
    digest = hashlib.sha256(f"shardkit.data.loader/{seed}/{epoch}/{batches}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: any torch.Generator takes it


class ElasticLoader(DataLoader):
    """``DataLoader(dataset, batch_sampler=sampler, ...)`` that keeps ``sampler``'s position exact.

    ``batch_sampler`` must be an :class:`ElasticSampler`; every other
    ``DataLoader`` argument works as usual (``num_workers``,
    ``prefetch_factor``, ``persistent_workers``, ``pin_memory``,
    ``collate_fn``, ...).  A ``generator=`` you pass is used as given
    (reproducible worker seeds are then your choice); by default the loader
    owns one.  Each ``iter(loader)`` continues at the sampler's position;
    breaking out of a loop and iterating again resumes at the first batch the
    loop did not receive.  Only the newest iterator may be used.
    """

    def __init__(self, dataset: Dataset, *, batch_sampler: ElasticSampler, **kwargs: Any) -> None:
        if not isinstance(batch_sampler, ElasticSampler):
            raise ConfigurationError(f"ElasticLoader needs an ElasticSampler as batch_sampler, got "
                                     f"{type(batch_sampler).__name__}")
        own_generator = kwargs.get("generator") is None
        if own_generator:
            kwargs["generator"] = torch.Generator()
        kwargs["collate_fn"] = _EmptyShareCollate(kwargs.get("collate_fn") or default_collate)
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self._elastic_sampler = batch_sampler
        self._own_generator = own_generator
        batch_sampler.count_consumption_externally()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self._elastic_sampler
        pass_id = sampler.start_pass()
        if self._own_generator:
            # Worker seeds become a function of where the data stands, not of how
            # many iterators this process happened to create before.
            self.generator.manual_seed(_worker_seed(sampler.seed, sampler.epoch, sampler.batches_consumed))
        return self._counted(super().__iter__(), pass_id)

    def _counted(self, batches: Iterator[Any], pass_id: int) -> Iterator[Any]:
        sampler = self._elastic_sampler
        for batch in batches:
            sampler.advance(pass_id)  # before the loop body: a save inside it counts this batch
            yield batch
