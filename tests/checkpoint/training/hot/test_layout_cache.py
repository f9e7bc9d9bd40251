"""The hot save's view of the state reused from save to save (training/hot/layout_cache.py): reused only while
the layout is the same, and then exactly what the full derivation gives -- the same keys, the same live
tensors, the values of this step, the same structure; any change of layout takes the full path."""

import torch
import torch.nn as nn

from shardkit.checkpoint.state.training_state import get_training_state
from shardkit.checkpoint.state.tree import from_json_value
from shardkit.checkpoint.training.hot.copies import local_state
from shardkit.checkpoint.training.hot.layout_cache import LayoutCache
from shardkit.data.rng import capture_rng_state


def _job():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _after_one_save() -> tuple[nn.Module, torch.optim.Optimizer, LayoutCache]:
    """A job, and a cache that has seen one save of it."""
    model, opt = _job()
    cache = LayoutCache()
    cache.local_state(get_training_state(model, opt))
    return model, opt, cache


def _same_as_full(cache: LayoutCache, state: dict) -> None:
    """The cache's view of ``state`` is the full derivation's: keys, tensor objects, values, structure."""
    got, want = cache.local_state(state), local_state(state)
    assert list(got.tensors) == list(want.tensors)
    assert all(got.tensors[k] is want.tensors[k] for k in want.tensors)
    assert got.values == want.values
    assert list(got.flat.tensors) == list(want.flat.tensors)
    assert all(got.flat.tensors[k] is want.flat.tensors[k] for k in want.flat.tensors)
    assert got.flat.values == want.flat.values and list(got.flat.slots) == list(want.flat.slots)
    assert got.structure == want.structure
    assert got.inputs.keys() == want.inputs.keys()


def test_a_repeated_save_reuses_the_layout_and_reads_this_steps_values():
    model, opt = _job()
    cache = LayoutCache()
    _same_as_full(cache, get_training_state(model, opt))
    for lr in (5e-4, 2.5e-4):
        opt.step()  # moments and step counters change in place
        opt.param_groups[0]["lr"] = lr
        state = get_training_state(model, opt)
        _same_as_full(cache, state)
        assert from_json_value(cache.local_state(state).values["optim.param_groups"])[0]["lr"] == lr
    assert cache.hits == 4


def test_the_input_state_beside_it_is_kept_as_given():
    model, opt = _job()
    cache = LayoutCache()
    for _ in range(2):
        rng = {"rng": {"world_size": 1, "rank0": capture_rng_state()}}
        got = cache.local_state({**get_training_state(model, opt), **rng})
        assert got.inputs["rng"] is rng["rng"] and not any(k.startswith("rng.") for k in got.tensors)
    assert cache.hits == 1


def test_a_replaced_parameter_of_another_shape_is_not_reused():
    model, opt = _job()
    cache = LayoutCache()
    before = cache.local_state(get_training_state(model, opt)).structure
    model[2].weight = nn.Parameter(torch.randn(2, 3).double())
    opt.param_groups[0]["params"][4] = model[2].weight
    state = get_training_state(model, opt)
    _same_as_full(cache, state)
    assert cache.hits == 0 and local_state(state).structure != before


def test_a_parameter_given_new_data_of_another_shape_is_not_reused():
    model, opt, cache = _after_one_save()
    model[0].bias.data = torch.zeros(5)
    _same_as_full(cache, get_training_state(model, opt))
    assert cache.hits == 0


def test_new_data_of_the_same_layout_is_copied_from_the_live_tensor():
    model, opt, cache = _after_one_save()
    model[0].bias.data = torch.full((3,), 7.0)
    got = cache.local_state(get_training_state(model, opt))
    assert cache.hits == 1 and torch.equal(got.tensors["model.0.bias"], torch.full((3,), 7.0))


def test_an_optimizer_state_tensor_replaced_by_one_of_the_same_layout_is_taken_from_this_step():
    model, opt, cache = _after_one_save()
    p = model[0].weight
    opt.state[p]["exp_avg"] = torch.ones_like(p)
    state = get_training_state(model, opt)
    _same_as_full(cache, state)
    assert cache.hits == 1
    assert torch.equal(cache.local_state(state).tensors["optim.state.0.weight.exp_avg"], torch.ones(3, 4))


def test_an_optimizer_state_tensor_of_another_dtype_is_not_reused():
    model, opt, cache = _after_one_save()
    p = model[0].weight
    opt.state[p]["exp_avg"] = torch.ones_like(p, dtype=torch.float64)
    _same_as_full(cache, get_training_state(model, opt))
    assert cache.hits == 0


def test_a_key_added_or_removed_is_not_reused():
    model, opt, cache = _after_one_save()
    model.register_buffer("seen", torch.zeros(2))
    _same_as_full(cache, get_training_state(model, opt))
    del model._buffers["seen"]
    _same_as_full(cache, get_training_state(model, opt))
    assert cache.hits == 0
