"""RNG files of a Trainer or Accelerate run: what they may hold is read, bounded, and nothing else is."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from shardkit.checkpoint.formats.trainer.rng import read_rng_state, rng_files
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import InvalidManifest, ShardkitError


def _trainer_rng(path, numpy_state=None) -> dict:
    """An RNG file as the Trainer writes it (``rng_state_<r>.pth``)."""
    state = {"python": random.getstate(), "numpy": numpy_state or np.random.get_state(),
             "cpu": torch.get_rng_state(), "cuda": [torch.get_rng_state(), torch.get_rng_state()]}
    torch.save(state, path)
    return state


def test_a_single_process_trainers_rng_state_is_rank_0_of_1_with_every_cuda_device(tmp_path):
    saved = _trainer_rng(tmp_path / "rng_state.pth")
    names = rng_files(["rng_state.pth", "trainer_state.json"])
    tensors, values = read_rng_state(Storage(str(tmp_path)), names)
    assert values["rng.world_size"] == 1 and values["rng.rank0.python.state"] == list(saved["python"][1])
    assert torch.equal(tensors["rng.rank0.torch"], saved["cpu"])
    assert torch.equal(tensors["rng.rank0.numpy.key"], torch.as_tensor(saved["numpy"][1].astype("int64")))
    assert {"rng.rank0.cuda.0", "rng.rank0.cuda.1"} <= set(tensors)


def test_a_missing_ranks_rng_file_is_an_error_naming_the_rank():
    with pytest.raises(InvalidManifest, match="rank 1's is missing"):
        rng_files(["rng_state_0.pth", "rng_state_2.pth"], "ckpt")


@pytest.mark.parametrize("array", [np.empty(3, dtype=object), np.zeros(4, dtype=np.float64)],
                         ids=["object-array", "float-array"])
def test_an_rng_file_holding_any_other_numpy_array_is_refused(tmp_path, array):
    """Only the uint32 key of a Mersenne Twister state is rebuilt: an object array (which could be made to
    allocate without bound, or hold anything) or any other dtype fails before any state is taken."""
    _trainer_rng(tmp_path / "rng_state_0.pth", numpy_state=("MT19937", array, 0, 0, 0.0))
    with pytest.raises(ShardkitError, match="uint32"):
        read_rng_state(Storage(str(tmp_path)), ["rng_state_0.pth"])
