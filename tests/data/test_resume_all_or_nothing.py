"""A resume whose input state cannot be restored as asked fails before any model or optimizer tensor is
written, on every rank; a resume that leaves saved input state alone says so."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn as nn

import shardkit.checkpoint as skc
from shardkit.data import ElasticSampler, Stateful
from shardkit.errors import DataStateError, PerRankStateError
from tests.support.dist import run_on_ranks


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def tensors_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [t.clone() for t in model.state_dict().values()]
    return state + [v.clone() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def saved_step(root: str, **inputs) -> skc.CheckpointManager:
    manager = skc.CheckpointManager(root)
    sampler = ElasticSampler(40, global_batch_size=10, rank=0, world_size=1)
    next(iter(sampler))
    manager.save(1, *trained(0), data=sampler, **inputs)
    return manager


@pytest.mark.parametrize("asked, error", [
    (dict(data=ElasticSampler(40, global_batch_size=20, rank=0, world_size=1)), DataStateError),
    (dict(stateful={"missing": Stateful(Counter(), "global")}), DataStateError),
])
def test_input_state_that_cannot_be_restored_fails_before_any_weight_or_moment_is_written(tmp_path, asked, error):
    manager = saved_step(str(tmp_path))
    model, optimizer = trained(1)
    before = tensors_of(model, optimizer)
    with pytest.raises(error):
        manager.load_latest(model, optimizer, **asked)
    after = tensors_of(model, optimizer)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    if "data" in asked:
        assert (asked["data"].epoch, asked["data"].batches_consumed) == (0, 0)


def _per_rank_counter_saved_on_two_ranks(root: str) -> None:
    import torch.distributed as dist

    manager = skc.CheckpointManager(root)
    manager.save(1, *trained(0), stateful={"counter": Stateful(Counter(dist.get_rank() + 5), "per_rank")})


def test_per_rank_state_that_cannot_map_onto_this_world_size_leaves_the_model_as_it_was(tmp_path):
    run_on_ranks(2, _per_rank_counter_saved_on_two_ranks, str(tmp_path))
    model, optimizer = trained(1)
    before = tensors_of(model, optimizer)
    counter = Counter(-1)
    with pytest.raises(PerRankStateError):
        skc.CheckpointManager(str(tmp_path)).load_latest(model, optimizer, rng=False,
                                                         stateful={"counter": Stateful(counter, "per_rank")})
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(model, optimizer), before)) and counter.value == -1


def _resume_with_a_sampler_only_rank_one_gets_wrong(root: str) -> tuple[str, bool]:
    import torch.distributed as dist

    model, optimizer = trained(1)
    before = tensors_of(model, optimizer)
    batch = 10 if dist.get_rank() == 0 else 20
    sampler = ElasticSampler(40, global_batch_size=batch)
    try:
        skc.CheckpointManager(root).load_latest(model, optimizer, data=sampler, rng=False)
    except DataStateError as exc:
        unchanged = all(torch.equal(a, b) for a, b in zip(tensors_of(model, optimizer), before))
        return type(exc).__name__, unchanged
    return "loaded", False


def test_every_rank_refuses_together_when_one_ranks_sampler_does_not_match(tmp_path):
    saved_step(str(tmp_path))
    assert run_on_ranks(2, _resume_with_a_sampler_only_rank_one_gets_wrong, str(tmp_path)) == \
        [("DataStateError", True)] * 2


def test_a_resume_without_the_sampler_says_at_info_that_the_step_holds_a_position(tmp_path, caplog):
    manager = saved_step(str(tmp_path), stateful={"counter": Stateful(Counter(3), "global")})
    with caplog.at_level(logging.INFO, logger="shardkit"):
        assert manager.load_latest(*trained(1))[0] == 1
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "does not restore" in r.message]
    assert len(said) == 1
    assert "ElasticSampler position (epoch 0, 1 global batches into it; pass data=" in said[0]
    assert "'counter' (pass stateful=" in said[0]


def test_a_malformed_rng_state_fails_the_resume_before_any_weight_is_written(tmp_path):
    manager = saved_step(str(tmp_path))
    manifest = tmp_path / "step-0000000001" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["values"] = {k: v for k, v in doc["values"].items() if not k.startswith("rng.rank0.python")}
    manifest.write_text(json.dumps(doc))
    model, optimizer = trained(1)
    before = tensors_of(model, optimizer)
    with pytest.raises(DataStateError, match="lacks 'python'"):
        manager.load_latest(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(model, optimizer), before))
