"""A resumed run is the same run: the manager carries the data position and the RNG with the weights.

1. Resumed at another world size, every following global batch holds the same
   samples as in the uninterrupted run and the losses agree within 1e-6 (the
   loss is the mean over the global batch, so it does not depend on the split).
2. Resumed at the same world size with dropout and random augmentation, the
   losses equal the uninterrupted run's bitwise; without restoring the RNG
   they do not.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit.checkpoint as skc
from shardkit.data import ElasticLoader, ElasticSampler
from tests.support.data_helpers import IndexedRegression
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow

NUM_SAMPLES, GLOBAL_BATCH, SEED = 96, 12, 5
STEPS, SAVE_AFTER = 12, 6  # 8 global batches an epoch: the run crosses an epoch boundary after the resume


def _model(dropout: float) -> nn.Module:
    import shardkit

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 1))
    for layer in (model[0], model[3]):
        shardkit.fully_shard(layer)
    shardkit.fully_shard(model)
    return model


def _train(root: str, *, resume: bool, save_after: int | None, num_workers: int = 0, dropout: float = 0.0,
           augment: bool = False, restore_rng: bool = True) -> list[tuple[list[int], float]]:
    """Run (or resume) the job on this rank; return (global batch sample indices, global loss) per step."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    random.seed(100 + rank), torch.manual_seed(100 + rank)  # what a fresh job seeds with
    model = _model(dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ElasticSampler(NUM_SAMPLES, global_batch_size=GLOBAL_BATCH, seed=SEED)
    manager = skc.CheckpointManager(root)
    start = 0
    if resume:
        start, _ = manager.load_latest(model, opt, data=sampler, rng=restore_rng, required=True)
    loader = ElasticLoader(IndexedRegression(NUM_SAMPLES), batch_sampler=sampler, num_workers=num_workers)
    records = []
    step = start
    while step < STEPS:
        for index, x, y in loader:
            if augment:  # random augmentation drawn from the global RNGs, as a data pipeline would
                x = x + 0.1 * torch.randn_like(x) * random.random()
            model.train()
            local = F.mse_loss(model(x), y)  # shares are equal (12 splits evenly over 1-4 ranks), and
            # fully_shard averages gradients over ranks: the gradient of the global batch's mean
            local.backward()
            opt.step()
            opt.zero_grad()
            total = local.detach().clone()
            dist.all_reduce(total)
            shares: list[list[int]] = [None] * world  # type: ignore[list-item]
            dist.all_gather_object(shares, index.tolist())
            records.append(([i for share in shares for i in share], float(total) / world))
            step += 1
            if step == save_after:
                manager.save(step, model, opt, data=sampler)
            if step == STEPS:
                break
    dist.barrier()
    return records if rank == 0 else None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_on_ranks(2, _train, str(tmp_path_factory.mktemp("full")), resume=False, save_after=None)[0]


@pytest.mark.parametrize("world,workers", [(1, 0), (2, 0), (3, 1), (4, 0)], ids=["ws1", "ws2", "ws3-workers", "ws4"])
def test_a_run_resumed_at_another_world_size_sees_the_same_batches_and_losses(tmp_path, uninterrupted, world,
                                                                             workers):
    root = str(tmp_path / "run")
    first = run_on_ranks(2, _train, root, resume=False, save_after=SAVE_AFTER)[0]
    assert first == uninterrupted  # the same run up to the save
    resumed = run_on_ranks(world, _train, root, resume=True, save_after=None, num_workers=workers)[0]
    assert len(resumed) == STEPS - SAVE_AFTER
    for (got_batch, got_loss), (want_batch, want_loss) in zip(resumed, uninterrupted[SAVE_AFTER:]):
        assert got_batch == want_batch
        assert abs(got_loss - want_loss) <= 1e-6 * abs(want_loss), (got_loss, want_loss)


def test_dropout_and_augmentation_continue_bitwise_only_with_the_rng_restored(tmp_path):
    kw = dict(dropout=0.3, augment=True)
    full = run_on_ranks(2, _train, str(tmp_path / "full"), resume=False, save_after=None, **kw)[0]
    root = str(tmp_path / "run")
    run_on_ranks(2, _train, root, resume=False, save_after=SAVE_AFTER, **kw)
    resumed = run_on_ranks(2, _train, root, resume=True, save_after=None, **kw)[0]
    assert [loss for _, loss in resumed] == [loss for _, loss in full[SAVE_AFTER:]]  # bitwise
    control = run_on_ranks(2, _train, root, resume=True, save_after=None, restore_rng=False, **kw)[0]
    assert [batch for batch, _ in control] == [batch for batch, _ in full[SAVE_AFTER:]]  # same data...
    assert [loss for _, loss in control] != [loss for _, loss in full[SAVE_AFTER:]]  # ...other random numbers
