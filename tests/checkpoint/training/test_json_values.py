"""A value a checkpoint cannot hold without pickle is refused, saying where it can go instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shardkit.checkpoint as skc
from shardkit.errors import ConfigurationError


def test_a_tensor_in_manager_extra_is_refused_naming_the_state_dict_and_stateful(tmp_path):
    manager = skc.CheckpointManager(str(tmp_path))
    with pytest.raises(ConfigurationError) as caught:
        manager.save(1, nn.Linear(2, 2), extra={"ema": torch.ones(2)}, rng=False)
    assert str(caught.value) == (
        "'extra.ema' holds a Tensor, which a checkpoint cannot store without pickle; extra holds JSON types only "
        "(None, bool, int, float, str, list, dict): put tensors in the state dict you save, or pass the object "
        "that owns them as CheckpointManager.save(..., stateful={'name': Stateful(obj)}), whose state_dict() may "
        "hold tensors")
    assert manager.steps() == []


def test_an_object_in_a_state_dict_is_refused_suggesting_a_tensor_or_json(tmp_path):
    with pytest.raises(ConfigurationError) as caught:
        skc.save({"model": {"w": torch.ones(2)}, "config": {"when": object()}}, str(tmp_path / "ckpt"))
    assert str(caught.value) == (
        "'config.when' holds an object, which a checkpoint cannot store without pickle; store it as a tensor in "
        "the state dict, or as JSON types (None, bool, int, float, str, list, dict)")
