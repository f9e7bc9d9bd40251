"""RNG state: captured as JSON and tensors, replayed bit for bit at the same world size, and
re-seeded by the documented rule (deterministic, distinct per rank, with a warning) at another."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardkit.data import capture_rng_state, reseeded_seeds, restore_rng_state
from shardkit.errors import DataStateError


@pytest.fixture(autouse=True)
def _leave_global_rngs_as_found():
    """These tests drive the process-wide generators; later tests get them back untouched."""
    python, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)


def draws() -> dict:
    """One of everything a training step draws: dropout, torch.rand, random, numpy (incl. a cached gaussian)."""
    return {
        "dropout": F.dropout(torch.ones(64), p=0.5, training=True),
        "rand": torch.rand(16),
        "python": [random.random() for _ in range(4)] + [random.gauss(0, 1)],
        "numpy": np.random.rand(4).tolist() + [float(np.random.standard_normal())],
    }


def assert_same_draws(a: dict, b: dict) -> None:
    assert torch.equal(a["dropout"], b["dropout"]) and torch.equal(a["rand"], b["rand"])
    assert a["python"] == b["python"] and a["numpy"] == b["numpy"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_restore_at_the_same_world_size_replays_dropout_rand_random_and_numpy_bitwise():
    seed_everything(0)
    draws()                                           # mid-stream, with gaussians cached
    random.gauss(0, 1)
    np.random.standard_normal()
    saved = capture_rng_state()
    expected = draws()
    draws()                                           # the run goes on ...
    restore_rng_state([saved], rank=0, world_size=1)  # ... and resumes from the capture
    assert_same_draws(draws(), expected)


def test_each_rank_gets_its_own_saved_stream_back_at_the_same_world_size():
    per_rank, expected = [], []
    for rank in range(3):
        seed_everything(100 + rank)
        per_rank.append(capture_rng_state())
        expected.append(draws())
    for rank in (2, 0, 1):
        restore_rng_state(per_rank, rank=rank, world_size=3)
        assert_same_draws(draws(), expected[rank])


def test_captured_state_is_json_values_and_tensors_only():
    state = capture_rng_state()
    torch_state, key = state.pop("torch"), state["numpy"].pop("key")
    assert torch_state.dtype == torch.uint8 and torch_state.shape == torch.get_rng_state().shape
    assert key.dtype == torch.int64 and key.shape == (624,)
    assert set(state) == {"python", "numpy"}          # no CUDA initialised here
    assert json.loads(json.dumps(state)) == state
    assert len(state["python"]["state"]) == 625 and state["numpy"]["kind"] == "MT19937"


def _streams_after_restore(saved: list, rank: int, world_size: int) -> dict:
    restore_rng_state(saved, rank=rank, world_size=world_size)
    return draws()


def test_another_world_size_reseeds_deterministically_distinct_per_rank_and_warns(caplog):
    saved = []
    for rank in range(2):
        seed_everything(rank)
        saved.append(capture_rng_state())
    originals = []
    for rank in range(2):
        restore_rng_state(saved, rank=rank, world_size=2)
        originals.append(draws())

    with caplog.at_level(logging.WARNING, logger="shardkit.data.rng"):
        first = [_streams_after_restore(saved, r, 3) for r in range(3)]
    warnings = [r for r in caplog.records if r.name == "shardkit.data.rng" and r.levelno == logging.WARNING]
    again = [_streams_after_restore(saved, r, 3) for r in range(3)]
    for a, b in zip(first, again):
        assert_same_draws(a, b)                       # deterministic for a checkpoint and a rank
    masks = {tuple(d["dropout"].tolist()) for d in first} | {tuple(d["dropout"].tolist()) for d in originals}
    pythons = {tuple(d["python"]) for d in first} | {tuple(d["python"]) for d in originals}
    numpys = {tuple(d["numpy"]) for d in first} | {tuple(d["numpy"]) for d in originals}
    assert len(masks) == len(pythons) == len(numpys) == 5  # 3 new ranks, 2 old streams: all different

    assert [r.getMessage() for r in warnings] == [
        f"RNG state was saved by 2 ranks and is restored on 3: per-rank random streams (dropout, augmentation) "
        f"cannot continue exactly at another world size; rank {r} re-seeds random, numpy and torch from saved "
        f"rank {r % 2}'s state salted with its rank (deterministic, distinct per rank)" for r in range(3)]


def test_new_rank_r_reseeds_from_saved_rank_r_mod_old_world_salted_with_r():
    saved = []
    for rank in range(2):
        seed_everything(rank)
        saved.append(capture_rng_state())
    restore_rng_state(saved, rank=3, world_size=4)
    got = (random.random(), torch.rand(2), np.random.rand())
    seeds = reseeded_seeds(saved[3 % 2], 3)
    random.seed(seeds["python"])
    torch.manual_seed(seeds["torch"])
    np.random.seed(seeds["numpy"])
    assert got[0] == random.random() and torch.equal(got[1], torch.rand(2)) and got[2] == np.random.rand()
    assert 0 <= seeds["torch"] < 2**63 and 0 <= seeds["numpy"] < 2**32
    assert reseeded_seeds(saved[0], 3) != seeds and reseeded_seeds(saved[1], 1) != reseeded_seeds(saved[1], 3)


def test_a_malformed_state_is_refused_naming_the_rank():
    good = capture_rng_state()
    with pytest.raises(DataStateError, match="saved RNG state of rank 1 lacks 'torch'"):
        restore_rng_state([good, {"python": good["python"]}], rank=1, world_size=2)
    with pytest.raises(DataStateError, match="rank 2 is outside world size 2"):
        restore_rng_state([good, good], rank=2, world_size=2)


@pytest.mark.cuda
def test_cuda_generators_are_captured_and_replayed():
    torch.cuda.init()
    torch.cuda.manual_seed_all(3)
    saved = capture_rng_state()
    assert set(saved["cuda"]) == {str(i) for i in range(torch.cuda.device_count())}
    expected = torch.rand(8, device="cuda")
    torch.rand(8, device="cuda")
    restore_rng_state([saved], rank=0, world_size=1)
    assert torch.equal(torch.rand(8, device="cuda"), expected)
