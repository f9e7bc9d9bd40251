"""The one walker of nested state: paths, order and slots of every leaf, with the reader's rule of what
is walked into."""

from __future__ import annotations

import pytest
import torch

from shardkit.checkpoint.state.tree import flatten, walk
from shardkit.errors import ConfigurationError


def _dicts_and_lists(_path, value):
    return isinstance(value, (dict, list))


def test_every_leaf_comes_with_its_dotted_path_and_slot_depth_first_in_order():
    inner = [10, {"b": 20}]
    tree = {"a": inner, "c": 30}
    assert list(walk(tree, _dicts_and_lists)) == [
        ("a.0", inner, 0, 10), ("a.1.b", inner[1], "b", 20), ("c", tree, "c", 30)]


def test_the_reader_rule_decides_what_is_a_leaf():
    tree = {"betas": [0.9, 0.999], "groups": [{"lr": 0.1}]}

    def lists_of_dicts(_path, value):
        return isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, dict) for v in value))

    assert [(path, value) for path, _, _, value in walk(tree, lists_of_dicts)] == [
        ("betas", [0.9, 0.999]), ("groups.0.lr", 0.1)]


def test_the_rule_is_asked_with_each_entry_path_and_value_in_turn():
    asked = []

    def record(path, value):
        asked.append(path)
        return isinstance(value, dict)

    list(walk({"x": {"y": 1, "z": (2,)}, "w": 3}, record, prefix="root"))
    assert asked == ["root.x", "root.x.y", "root.x.z", "root.w"]


def test_a_leaf_or_an_empty_container_has_nothing_to_walk():
    assert list(walk(torch.ones(1), _dicts_and_lists)) == []
    assert list(walk({"a": {}, "b": []}, _dicts_and_lists)) == []


def test_flatten_walks_lists_holding_tensors_and_keeps_other_lists_as_values():
    w = torch.ones(1)
    flat = flatten({"optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.999)}]}, "buffers": [w]})
    assert list(flat.tensors) == ["buffers.0"]
    assert flat.tensors["buffers.0"] is w
    assert flat.values == {"optim.param_groups": [{"lr": 0.1, "betas": [0.9, 0.999]}]}


def test_flatten_refuses_a_key_that_is_not_a_string_naming_where():
    with pytest.raises(ConfigurationError) as caught:
        flatten({"optim": {"state": {0: {"step": torch.ones(1)}}}})
    assert str(caught.value) == "state dict key 0 under 'optim.state' is not a string"


def test_flatten_refuses_tensors_inside_a_tuple_naming_the_key():
    with pytest.raises(ConfigurationError) as caught:
        flatten({"model": {"pair": (torch.ones(1), torch.ones(1))}})
    assert str(caught.value) == "'model.pair': tensors inside a tuple cannot be loaded in place; use a list"
