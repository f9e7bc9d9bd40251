"""FSDP1 auto-wrap policies decide exactly what torch's FSDP1 decides, and
``apply_fully_shard`` shards bottom-up, then the root.

torch's own recursive wrap (with a recording wrapper that changes nothing) is
the oracle for the callable policies; shardkit code never imports it.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import wrap as torch_wrap

from shardkit import wrap as sk_wrap
from shardkit.errors import ConfigurationError
from tests.support.models import Attention, Block, FeedForward, ModelArgs, Transformer


class WithMHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.mha = nn.MultiheadAttention(32, 4)
        self.head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        self.blocks = nn.ModuleDict({"a": nn.Linear(32, 32), "b": nn.Linear(32, 32)})

    def forward(self, x):
        h = self.embed(x)
        h = self.mha(h, h, h)[0]
        h = self.blocks["b"](self.blocks["a"](h))
        return self.head(h)


def _torch_plan(model: nn.Module, policy, ignored_modules=()) -> list[str]:
    """Names torch FSDP1's recursive wrap would wrap (the root excluded), in call order."""
    names = {m: n for n, m in model.named_modules()}
    ignored = {sub for m in ignored_modules for sub in m.modules()}
    ignored_params = {p for m in ignored for p in m.parameters()}
    calls: list[str] = []

    def record(module, **kwargs):
        calls.append(names[module])
        return module

    torch_wrap._recursive_wrap(model, policy, record, ignored, ignored_params, only_wrap_children=True)
    return calls


def _our_plan(model: nn.Module, policy, ignored_modules=()) -> list[str]:
    return [t.name for t in sk_wrap.plan_auto_wrap(model, policy, ignored_modules=ignored_modules)]


def test_transformer_policy_makes_each_block_a_unit():
    model = Transformer(ModelArgs(n_layers=3))
    policy = functools.partial(sk_wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    assert _our_plan(model, policy) == ["layers.0", "layers.1", "layers.2"]
    torch_policy = functools.partial(torch_wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    assert _our_plan(model, policy) == _torch_plan(model, torch_policy)


@pytest.mark.parametrize("min_num_params", [1, 30, 700, 1500, 3000, 6000, 20000, int(1e8)])
def test_size_based_policy_matches_torch_fsdp1_at_every_threshold(min_num_params):
    for model in (Transformer(ModelArgs(n_layers=2)), WithMHA()):
        ours = functools.partial(sk_wrap.size_based_auto_wrap_policy, min_num_params=min_num_params)
        theirs = functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=min_num_params)
        assert _our_plan(model, ours) == _torch_plan(model, theirs)


def test_size_based_defaults_are_fsdp1s():
    policy = sk_wrap.size_based_auto_wrap_policy
    assert policy.FORCE_LEAF_MODULES == {nn.MultiheadAttention}
    assert policy.EXCLUDE_WRAP_MODULES == {nn.ModuleList, nn.ModuleDict}
    big = nn.Linear(1, 1)
    assert policy(big, recurse=False, nonwrapped_numel=int(1e8)) is True
    assert policy(big, recurse=False, nonwrapped_numel=int(1e8) - 1) is False
    assert policy(nn.ModuleList([big]), recurse=False, nonwrapped_numel=int(1e9)) is False
    assert policy(nn.ModuleList([big]), recurse=True, nonwrapped_numel=int(1e9)) is True
    assert policy(nn.MultiheadAttention(4, 2), recurse=True, nonwrapped_numel=int(1e9)) is False
    assert policy(nn.MultiheadAttention(4, 2), recurse=False, nonwrapped_numel=int(1e9)) is True


def test_size_based_never_descends_into_forced_leaves():
    # FSDP1: a forced leaf is not descended into, and is not a unit either; its
    # parameters go to the enclosing unit.
    model = WithMHA()
    plan = _our_plan(model, functools.partial(sk_wrap.size_based_auto_wrap_policy, min_num_params=1))
    assert not any(name == "mha" or name.startswith("mha.") for name in plan)
    # the ModuleDict itself is excluded; its Linears are units
    assert "blocks" not in plan and {"blocks.a", "blocks.b"} <= set(plan)


def test_size_based_counts_only_parameters_no_inner_unit_took():
    # head = Linear(32,64)+Linear(64,10): 2112 + 650 params.  With threshold 700
    # the first Linear becomes a unit and the remainder (650) keeps the
    # Sequential from becoming one; with threshold 600 both Linears do.
    model = WithMHA()
    plan = _our_plan(model, functools.partial(sk_wrap.size_based_auto_wrap_policy, min_num_params=700))
    assert "head.0" in plan and "head.2" not in plan and "head" not in plan
    plan = _our_plan(model, functools.partial(sk_wrap.size_based_auto_wrap_policy, min_num_params=600))
    assert "head.0" in plan and "head.2" in plan and "head" not in plan


def test_lambda_policy_matches_torch_fsdp1():
    model = Transformer(ModelArgs(n_layers=2))
    fn = lambda m: isinstance(m, (FeedForward, nn.Embedding))  # noqa: E731
    ours = functools.partial(sk_wrap.lambda_auto_wrap_policy, lambda_fn=fn)
    theirs = functools.partial(torch_wrap.lambda_auto_wrap_policy, lambda_fn=fn)
    assert _our_plan(model, ours) == _torch_plan(model, theirs)
    assert _our_plan(model, ours) == ["tok_embeddings", "pos_embeddings", "layers.0.feed_forward",
                                      "layers.1.feed_forward"]


def test_or_policy_unions_its_policies():
    model = Transformer(ModelArgs(n_layers=2))
    policy = functools.partial(sk_wrap._or_policy, policies=[
        functools.partial(sk_wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        functools.partial(sk_wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: m is model.output),
    ])
    assert _our_plan(model, policy) == ["layers.0", "layers.1", "output"]


def test_module_wrap_policy_picks_classes_children_first():
    model = Transformer(ModelArgs(n_layers=2))
    policy = sk_wrap.ModuleWrapPolicy({Block, Attention})
    assert _our_plan(model, policy) == ["layers.0.attention", "layers.0", "layers.1.attention", "layers.1"]
    torch_targets = torch_wrap.ModuleWrapPolicy({Block, Attention})._run_policy(model, set(), {})
    assert set(_our_plan(model, policy)) == {n for n, m in model.named_modules() if m in torch_targets}
    # callable with FSDP1's contract too
    assert policy(model.layers[0], recurse=False, nonwrapped_numel=-1) is True
    assert policy(model.norm, recurse=False, nonwrapped_numel=-1) is False
    assert policy(model.norm, recurse=True, nonwrapped_numel=-1) is True


def test_custom_policy_carries_argument_overrides():
    model = Transformer(ModelArgs(n_layers=2))

    def lambda_fn(module):
        if module is model.output:
            return {"reshard_after_forward": False}
        return isinstance(module, Block)

    plan = sk_wrap.plan_auto_wrap(model, sk_wrap.CustomPolicy(lambda_fn))
    assert [(t.name, t.overrides) for t in plan] == [
        ("layers.0", {}), ("layers.1", {}), ("output", {"reshard_after_forward": False})]


def test_custom_policy_rejects_non_bool_non_dict_answers():
    with pytest.raises(ConfigurationError, match="CustomPolicy"):
        sk_wrap.plan_auto_wrap(nn.Linear(2, 2), sk_wrap.CustomPolicy(lambda m: "yes"))


def test_ignored_modules_are_never_units_and_not_counted():
    model = Transformer(ModelArgs(n_layers=2))
    ignored = [model.layers[1]]
    policy = functools.partial(sk_wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    assert _our_plan(model, policy, ignored) == ["layers.0"]
    size = functools.partial(sk_wrap.size_based_auto_wrap_policy, min_num_params=3000)
    torch_size = functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=3000)
    assert _our_plan(model, size, ignored) == _torch_plan(model, torch_size, ignored)
    custom = sk_wrap.CustomPolicy(lambda m: isinstance(m, nn.Linear))
    assert not any(n.startswith("layers.1.") for n in _our_plan(model, custom, ignored))


def test_container_without_forward_is_skipped_with_one_warning():
    model = Transformer(ModelArgs(n_layers=2))
    sk_wrap.warned_keys.clear()
    policy = functools.partial(sk_wrap.lambda_auto_wrap_policy,
                               lambda_fn=lambda m: isinstance(m, (nn.ModuleList, Block)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _our_plan(model, policy) == ["layers.0", "layers.1"]
        assert _our_plan(model, policy) == ["layers.0", "layers.1"]
    messages = [str(w.message) for w in caught if "no forward of its own" in str(w.message)]
    assert len(messages) == 1 and "'layers'" in messages[0]


def test_no_policy_plans_nothing():
    assert sk_wrap.plan_auto_wrap(Transformer(), None) == []


def test_apply_fully_shard_goes_bottom_up_then_root_with_overrides():
    model = Transformer(ModelArgs(n_layers=2))
    names = {m: n for n, m in model.named_modules()}
    calls = []

    def record(module, **kwargs):
        calls.append((names[module], kwargs))

    policy = sk_wrap.CustomPolicy(
        lambda m: {"reshard_after_forward": 2} if m is model.layers[1] else isinstance(m, Block))
    out = sk_wrap.apply_fully_shard(model, policy, shard_fn=record, reshard_after_forward=True)
    assert out is model
    assert calls == [("layers.0", {"reshard_after_forward": True}),
                     ("layers.1", {"reshard_after_forward": 2}),
                     ("", {"reshard_after_forward": True})]


def test_apply_fully_shard_passes_ignored_module_params_as_ignored_params():
    model = Transformer(ModelArgs(n_layers=2))
    seen = []
    extra = nn.Parameter(torch.zeros(1))
    sk_wrap.apply_fully_shard(model, sk_wrap.ModuleWrapPolicy({Block}), ignored_modules=[model.layers[1]],
                              shard_fn=lambda m, **kw: seen.append((m, kw["ignored_params"])),
                              ignored_params={extra})
    expected = set(model.layers[1].parameters()) | {extra}
    assert [m for m, _ in seen] == [model.layers[0], model]
    assert all(params == expected for _, params in seen)


def test_enable_wrap_applies_the_wrapper_only_inside_the_context():
    calls = []

    def wrapper(module, **kwargs):
        calls.append(kwargs)
        return module

    lin = nn.Linear(2, 2)
    assert sk_wrap.wrap(lin) is lin and calls == []
    with sk_wrap.enable_wrap(wrapper_cls=wrapper, a=1, b=2):
        assert sk_wrap.wrap(lin, b=3) is lin
        with pytest.raises(ConfigurationError):
            with sk_wrap.enable_wrap(wrapper_cls=wrapper):
                pass
    assert calls == [{"a": 1, "b": 3}]
    assert sk_wrap.wrap(lin) is lin and len(calls) == 1


def test_walk_modules_orders_parents_or_children_first_and_stops_where_told():
    model = Transformer(ModelArgs(n_layers=2))
    model.layers[1].shared = model.layers[0].attention  # one module reachable twice: visited once
    names = {m: n for n, m in model.named_modules()}
    parents_first = [names[m] for m in sk_wrap.walk_modules(model)]
    assert parents_first == [n for n, _ in model.named_modules()]
    children_first = [names[m] for m in sk_wrap.walk_modules(model, children_first=True)]
    assert sorted(children_first) == sorted(parents_first) and children_first[-1] == ""
    assert all(children_first.index(n) < children_first.index(n.rsplit(".", 1)[0] if "." in n else "")
               for n in children_first if n)
    stopped = sk_wrap.walk_modules(model, enter=lambda m: not isinstance(m, Block))
    assert not any(isinstance(m, (Block, Attention, FeedForward)) for m in stopped) and model.layers in stopped
