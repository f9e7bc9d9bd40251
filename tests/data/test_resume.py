"""Sampler, per-rank objects and RNG together on real gloo ranks: a 2-rank run saved mid-epoch
resumes bit-identically on 2 ranks, and on 3 ranks with exactly the next global batches; the
saved form goes through a real checkpoint and back."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import shardkit.checkpoint as skc
from shardkit.data import ElasticLoader, ElasticSampler, Stateful, data_state_dict, load_data_state_dict, nest
from shardkit.errors import DataStateError, PerRankStateError
from tests.support.data_helpers import ShardReader
from tests.support.dist import run_on_ranks

NUM_SAMPLES, GLOBAL_BATCH, SEED = 40, 5, 3          # 8 global batches per epoch, split 3+2 on 2 ranks
SAVE_AFTER, THEN = 6, 5                              # save 6 steps in, then 5 more (across the epoch end)


class IndexDataset(Dataset):
    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> int:
        return i


def _steps(loader: ElasticLoader, reader: ShardReader, count: int, save_at: int | None = None):
    """Train-like steps: each draws a dropout mask and python/numpy numbers, as augmentation would."""
    record, saved = [], None
    while len(record) < count:                       # epochs
        for batch in loader:
            shares = batch.tolist() if isinstance(batch, torch.Tensor) else batch
            reader.samples += len(shares)
            mask = F.dropout(torch.ones(16), p=0.5, training=True)
            record.append((shares, mask, random.random(), float(np.random.rand())))
            if len(record) == save_at:
                saved = data_state_dict(loader.batch_sampler, {"reader": Stateful(reader, "per_rank")})
            if len(record) == count:
                break
    return record, saved


def _run_and_save():
    import torch.distributed as dist

    rank = dist.get_rank()
    random.seed(rank), np.random.seed(rank), torch.manual_seed(rank)
    sampler = ElasticSampler(NUM_SAMPLES, global_batch_size=GLOBAL_BATCH, seed=SEED)
    loader = ElasticLoader(IndexDataset(), batch_sampler=sampler, num_workers=2, persistent_workers=True)
    record, saved = _steps(loader, ShardReader(), SAVE_AFTER + THEN, save_at=SAVE_AFTER)
    return saved, record[SAVE_AFTER:]


def _resume(saved, reshard=None):
    import torch.distributed as dist

    random.seed(999), np.random.seed(999), torch.manual_seed(999)   # whatever the new job seeds with
    sampler = ElasticSampler(NUM_SAMPLES, global_batch_size=GLOBAL_BATCH, seed=SEED)
    reader = ShardReader()
    load_data_state_dict(saved, sampler, {"reader": Stateful(reader, "per_rank", reshard=reshard)})
    loader = ElasticLoader(IndexDataset(), batch_sampler=sampler, num_workers=2, persistent_workers=True)
    restored_samples = reader.samples
    record, _ = _steps(loader, reader, THEN)
    return restored_samples, record, dist.get_rank()


def _sum_of_old_ranks(states, rank, world_size):
    return {"samples": sum(s["samples"] for s in states[rank::world_size])}


def _joined(records_by_rank):
    return [[i for shares in step for i in shares] for step in zip(*[[r[0] for r in rec] for rec in records_by_rank])]


def expected_continuation() -> list[list[int]]:
    """Global batches 6, 7 of epoch 0 and 0, 1, 2 of epoch 1, written out from the documented rule."""
    batches = []
    for epoch in (0, 1):
        perm = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        batches += [perm[i:i + GLOBAL_BATCH] for i in range(0, NUM_SAMPLES, GLOBAL_BATCH)]
    return batches[SAVE_AFTER:SAVE_AFTER + THEN]


@pytest.fixture(scope="module")
def two_rank_run():
    return run_on_ranks(2, _run_and_save)


def test_two_rank_sampler_and_rng_resume_bit_identically_on_two_ranks(two_rank_run):
    (saved, after0), (saved1, after1) = two_rank_run
    assert saved["data"] == saved1["data"] and saved["rng"].keys() == {"world_size", "rank0", "rank1"}
    assert saved["data"]["sampler"]["epoch"] == 0 and saved["data"]["sampler"]["batches"] == SAVE_AFTER
    assert _joined([after0, after1]) == expected_continuation()

    resumed = run_on_ranks(2, _resume, saved)
    for (restored, record, rank), original in zip(resumed, (after0, after1)):
        assert restored == [3, 2][rank] * SAVE_AFTER    # rank 0 took 3 of each 5, rank 1 took 2
        assert len(record) == len(original) == THEN
        for (shares, mask, py, npy), (o_shares, o_mask, o_py, o_npy) in zip(record, original):
            assert shares == o_shares and torch.equal(mask, o_mask) and py == o_py and npy == o_npy


def test_two_rank_save_resumes_on_three_ranks_with_the_next_global_batches_and_new_rank_streams(two_rank_run):
    (saved, after0), (_, after1) = two_rank_run
    resumed = run_on_ranks(3, _resume, saved, _sum_of_old_ranks)
    records = [record for _, record, _ in resumed]
    assert _joined(records) == expected_continuation()
    assert [restored for restored, _, _ in resumed] == [3 * SAVE_AFTER, 2 * SAVE_AFTER, 0]
    assert [[len(r[0]) for r in rec] for rec in records] == [[2] * THEN, [2] * THEN, [1] * THEN]
    first_masks = {tuple(rec[0][1].tolist()) for rec in records + [after0, after1]}
    assert len(first_masks) == 5                       # 3 re-seeded ranks and the 2 old streams all differ


def test_a_per_rank_object_saved_by_two_ranks_is_refused_on_one_without_reshard(two_rank_run):
    (saved, _), _ = two_rank_run
    with pytest.raises(PerRankStateError, match="'reader' \\(ShardReader\\) was saved per rank by 2 ranks and "
                                                "this run has 1"):
        load_data_state_dict(saved, objects={"reader": Stateful(ShardReader(), "per_rank")}, rng=False,
                             rank=0, world_size=1)


def read_input_state(url: str) -> dict:
    """What the checkpoint manager does on resume: every data.*/rng.* key, whatever world size saved them."""
    reader = skc.open_reader(url)
    try:
        ours = ("data.", "rng.")
        values = {k: v for k, v in reader.values().items() if k.startswith(ours)}
        targets = {k: torch.empty(e.shape, dtype=e.dtype) for k, e in reader.tensors().items() if k.startswith(ours)}
    finally:
        reader.close()
    skc.load(nest(targets), url, strict=False)
    return nest({**values, **targets})


def test_the_saved_form_goes_through_a_real_checkpoint_and_resumes_from_it(two_rank_run, tmp_path):
    (saved, after0), (_, after1) = two_rank_run
    url = str(tmp_path / "step-6")
    skc.save({"model": {"w": torch.ones(3)}, **saved}, url)
    back = read_input_state(url)
    assert back["data"] == saved["data"]
    for rank in ("rank0", "rank1"):
        assert back["rng"][rank]["python"] == saved["rng"][rank]["python"]
        assert torch.equal(back["rng"][rank]["torch"], saved["rng"][rank]["torch"])
        assert torch.equal(back["rng"][rank]["numpy"]["key"], saved["rng"][rank]["numpy"]["key"])

    resumed = run_on_ranks(2, _resume, back)
    for (_, record, _), original in zip(resumed, (after0, after1)):
        assert all(torch.equal(a[1], b[1]) and a[0] == b[0] for a, b in zip(record, original))


def _save_with_another_object_on_rank_one():
    import torch.distributed as dist

    objects = {"reader": Stateful(ShardReader(), "per_rank")}
    if dist.get_rank() == 1:
        objects["extra"] = Stateful(ShardReader())
    try:
        data_state_dict(objects=objects, rng=False)
    except DataStateError as exc:
        return str(exc)
    return None


def test_ranks_that_disagree_about_what_to_save_all_get_the_same_clear_error():
    said = run_on_ranks(2, _save_with_another_object_on_rank_one)
    assert said[0] == ("data_state_dict was called with other arguments on rank 1 than on this rank: every rank "
                       "must pass a sampler or none, the same object names (['reader'] here, ['extra', 'reader'] "
                       "there) and the same rng flag")
    assert said[1] is not None and said[1].startswith("data_state_dict was called with other arguments on rank 0")
