"""ElasticSampler: one global batch sequence at every world size, and a position that resumes
with exactly the next global batch -- also through DataLoader workers that prefetch."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from shardkit.data import ElasticLoader, ElasticSampler, share_bounds
from shardkit.errors import ConfigurationError, DataStateError
from tests.support.data_helpers import IndexDataset


def expected_global_batches(n: int, batch: int, seed: int, epoch: int, drop_last: bool) -> list[list[int]]:
    """The documented sequence, written out independently of the sampler."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    stop = n - n % batch if drop_last else n
    return [perm[i:i + batch] for i in range(0, stop, batch)]


def samplers(world_size: int, n: int, batch: int, **kwargs) -> list[ElasticSampler]:
    return [ElasticSampler(n, global_batch_size=batch, rank=r, world_size=world_size, **kwargs)
            for r in range(world_size)]


def global_steps(ranks: list, steps: int | None = None) -> list[list[int]]:
    """Run every rank's iterator in lockstep and join each step's shares in rank order."""
    out = []
    for shares in zip(*ranks):
        out.append([i for share in shares for i in share])
        if steps is not None and len(out) == steps:
            break
    return out


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_global_batches_are_the_same_at_every_world_size_for_two_epochs(world_size, drop_last):
    ranks = samplers(world_size, 23, 8, seed=5, drop_last=drop_last)
    for epoch in range(2):
        seen = global_steps([iter(s) for s in ranks])
        assert seen == expected_global_batches(23, 8, 5, epoch, drop_last)
        assert all(s.epoch == epoch + 1 and s.batches_consumed == 0 for s in ranks)
    assert len(ranks[0]) == (2 if drop_last else 3)


def test_epochs_reshuffle_with_seed_plus_epoch():
    sampler = ElasticSampler(12, global_batch_size=4, seed=7, rank=0, world_size=1)
    epoch0, epoch1 = list(sampler), list(sampler)
    assert epoch0 == expected_global_batches(12, 4, 7, 0, True)
    assert epoch1 == expected_global_batches(12, 4, 7, 1, True)
    assert epoch0 != epoch1
    assert sampler.permutation(1).tolist() == torch.randperm(12, generator=torch.Generator().manual_seed(8)).tolist()


def test_without_shuffle_every_epoch_is_in_index_order():
    sampler = ElasticSampler(10, global_batch_size=4, shuffle=False, drop_last=False, rank=0, world_size=1)
    assert list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_uneven_splits_give_the_first_ranks_one_more_sample_and_may_leave_a_share_empty():
    assert [share_bounds(8, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert [share_bounds(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    ranks = samplers(4, 10, 8, shuffle=False, drop_last=False)
    shares = [list(s) for s in ranks]
    assert shares == [[[0, 1], [8]], [[2, 3], [9]], [[4, 5], []], [[6, 7], []]]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("saved_at,resumed_at", [(1, 4), (4, 1), (2, 3), (3, 2), (4, 4), (2, 2)])
def test_position_saved_at_one_world_size_resumes_at_another_with_the_next_global_batch(saved_at, resumed_at,
                                                                                        drop_last):
    n, batch = 45, 8                                      # 5 full global batches + 5 left over
    before = samplers(saved_at, n, batch, seed=3, drop_last=drop_last)
    global_steps([iter(s) for s in before])               # all of epoch 0
    global_steps([iter(s) for s in before], steps=2)      # two steps into epoch 1
    state = before[0].state_dict()
    assert state == {"epoch": 1, "batches": 2, "num_samples": n, "global_batch_size": batch, "seed": 3,
                     "shuffle": True, "drop_last": drop_last}
    assert all(s.state_dict() == state for s in before)

    after = samplers(resumed_at, n, batch, seed=3, drop_last=drop_last)
    for s in after:
        s.load_state_dict(state)
    resumed = global_steps([iter(s) for s in after]) + global_steps([iter(s) for s in after])
    expected = expected_global_batches(n, batch, 3, 1, drop_last)[2:] + expected_global_batches(n, batch, 3, 2,
                                                                                                 drop_last)
    assert resumed == expected


def _received_through_loader(sampler: ElasticSampler, dataset: Dataset, steps: int, **loader_kwargs) -> list:
    loader = ElasticLoader(dataset, batch_sampler=sampler, **loader_kwargs)
    got = []
    for batch in loader:
        got.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)
        if len(got) == steps:
            break
    return got


@pytest.mark.parametrize("persistent", [False, True])
def test_two_prefetching_workers_neither_skip_nor_repeat_batches_after_resume_at_another_world_size(persistent):
    dataset, n, batch = IndexDataset(64), 64, 8
    kwargs = dict(num_workers=2, prefetch_factor=2, persistent_workers=persistent)
    # two ranks train 3 steps; workers have asked for up to 4 more batches by then
    before = samplers(2, n, batch, seed=11)
    received = [_received_through_loader(s, dataset, 3, **kwargs) for s in before]
    state = before[0].state_dict()
    assert state["epoch"] == 0 and state["batches"] == 3
    assert [a + b for a, b in zip(*received)] == expected_global_batches(n, batch, 11, 0, True)[:3]

    # three ranks resume: the rest of epoch 0, then epoch 1, through the natural loop
    after = samplers(3, n, batch, seed=11)
    loaders = []
    for s in after:
        s.load_state_dict(state)
        loaders.append(ElasticLoader(dataset, batch_sampler=s, **kwargs))
    resumed = []
    for _ in range(2):
        for shares in zip(*loaders):
            resumed.append([i for share in shares for i in share.tolist()])
    assert resumed == expected_global_batches(n, batch, 11, 0, True)[3:] + expected_global_batches(n, batch, 11, 1,
                                                                                                   True)
    assert after[0].state_dict()["epoch"] == 2 and after[0].state_dict()["batches"] == 0


@pytest.mark.parametrize("persistent", [False, True])
def test_breaking_out_and_iterating_the_same_loader_again_continues_at_the_first_batch_not_received(persistent):
    sampler = ElasticSampler(40, global_batch_size=4, seed=2, rank=0, world_size=1)
    loader = ElasticLoader(IndexDataset(40), batch_sampler=sampler, num_workers=2, persistent_workers=persistent)
    first = []
    for batch in loader:
        first.append(batch.tolist())
        if len(first) == 3:
            break
    rest = [batch.tolist() for batch in loader]
    assert first + rest == expected_global_batches(40, 4, 2, 0, True)
    assert [batch.tolist() for batch in loader] == expected_global_batches(40, 4, 2, 1, True)


def test_a_save_inside_the_loop_body_counts_the_batch_being_trained_on():
    sampler = ElasticSampler(16, global_batch_size=4, rank=0, world_size=1)
    positions = [sampler.state_dict()["batches"] for _ in ElasticLoader(IndexDataset(16), batch_sampler=sampler,
                                                                         num_workers=2)]
    assert positions == [1, 2, 3, 0]                       # the fourth rolls over to epoch 1
    assert sampler.epoch == 1


def test_empty_shares_reach_the_loop_as_empty_lists_through_the_loader():
    ranks = samplers(4, 10, 8, shuffle=False, drop_last=False)
    got = [_received_through_loader(s, IndexDataset(10), 10, num_workers=0) for s in ranks]
    assert got == [[[0, 1], [8]], [[2, 3], [9]], [[4, 5], []], [[6, 7], []]]


def test_creating_loader_iterators_leaves_the_global_torch_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    sampler = ElasticSampler(16, global_batch_size=4, rank=0, world_size=1)
    _received_through_loader(sampler, IndexDataset(16), 2, num_workers=0)
    _received_through_loader(sampler, IndexDataset(16), 1, num_workers=0)
    assert torch.equal(torch.rand(3), expected)


def test_a_plain_dataloader_with_workers_makes_state_dict_refuse_instead_of_lying(caplog):
    sampler = ElasticSampler(32, global_batch_size=4, rank=0, world_size=1)
    with caplog.at_level(logging.WARNING, logger="shardkit.data"):
        for i, _ in enumerate(DataLoader(IndexDataset(32), batch_sampler=sampler, num_workers=2)):
            if i == 1:
                break
    assert "ElasticLoader" in caplog.text
    with pytest.raises(DataStateError, match="prefetches batches the training loop has not received"):
        sampler.state_dict()


def test_a_plain_dataloader_without_workers_counts_exactly():
    sampler = ElasticSampler(32, global_batch_size=4, rank=0, world_size=1)
    for i, _ in enumerate(DataLoader(IndexDataset(32), batch_sampler=sampler, num_workers=0)):
        if i == 2:
            break
    assert sampler.state_dict()["batches"] == 3


def test_set_epoch_keeps_a_resumed_position_and_jumps_to_another_epoch():
    sampler = ElasticSampler(16, global_batch_size=4, seed=1, rank=0, world_size=1)
    sampler.load_state_dict({"epoch": 2, "batches": 1, "num_samples": 16, "global_batch_size": 4, "seed": 1,
                             "shuffle": True, "drop_last": True})
    sampler.set_epoch(2)
    assert list(sampler) == expected_global_batches(16, 4, 1, 2, True)[1:]
    sampler.set_epoch(5)
    assert list(sampler) == expected_global_batches(16, 4, 1, 5, True)


def test_an_iterator_replaced_by_load_state_dict_may_not_count():
    sampler = ElasticSampler(16, global_batch_size=4, rank=0, world_size=1)
    loader = ElasticLoader(IndexDataset(16), batch_sampler=sampler)
    old = iter(loader)
    next(old)
    sampler.load_state_dict(sampler.state_dict())
    with pytest.raises(DataStateError, match="newer iter"):
        next(old)


@pytest.mark.parametrize("field,value", [("num_samples", 17), ("global_batch_size", 8), ("seed", 1),
                                         ("shuffle", False), ("drop_last", False)])
def test_a_position_saved_for_another_sequence_is_refused_naming_the_field(field, value):
    saved = ElasticSampler(16, global_batch_size=4, rank=0, world_size=1).state_dict()
    saved[field] = value
    with pytest.raises(DataStateError, match=f"saved position is for {field}={value!r}"):
        ElasticSampler(16, global_batch_size=4, rank=0, world_size=1).load_state_dict(saved)


def test_arguments_that_give_no_batches_or_no_rank_are_refused():
    with pytest.raises(ConfigurationError, match="make no global batch of 8"):
        ElasticSampler(5, global_batch_size=8, rank=0, world_size=1)
    with pytest.raises(ConfigurationError, match="rank 2 is not below world_size 2"):
        ElasticSampler(5, global_batch_size=1, rank=2, world_size=2)
    with pytest.raises(ConfigurationError, match="needs an ElasticSampler"):
        ElasticLoader(IndexDataset(4), batch_sampler=[[0, 1]])
