"""Every FSDP1 constructor argument does what FSDP1 documents, or says once
that it cannot."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.tensor import DTensor

import shardkit.wrap as sk_wrap
from shardkit import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from shardkit import FullyShardedDataParallel as FSDP
from shardkit.errors import ConfigurationError
from shardkit.fsdp1 import mapping
from shardkit.runtime import sharded_params_of
from shardkit.wrap import CustomPolicy, ModuleWrapPolicy, transformer_auto_wrap_policy
from tests.support.dist import run_on_ranks
from tests.support.fsdp1_helpers import (
    CollectiveCounter,
    assert_close_losses,
    build_transformer,
    reference_losses,
    train_steps,
)
from tests.support.models import Block, ModelArgs, Transformer

POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})


# --------------------------------------------------------------------------
# pure mapping decisions


def test_strategy_layouts_are_fsdp1s():
    S = ShardingStrategy
    assert mapping.strategy_layout(S.FULL_SHARD, 8).shape == (8,)
    assert mapping.strategy_layout(None, 8).shape == (8,)
    assert mapping.strategy_layout(S.SHARD_GRAD_OP, 8).shape == (8,)
    assert mapping.strategy_layout(S.NO_SHARD, 8).shape == (8, 1)
    assert mapping.strategy_layout(S.HYBRID_SHARD, 8, 4).shape == (2, 4)
    assert mapping.strategy_layout(S._HYBRID_SHARD_ZERO2, 8, 2).shape == (4, 2)
    assert [mapping.reshard_after_forward(s) for s in S] == [True, False, True, True, False]
    with pytest.raises(ConfigurationError, match="does not divide"):
        mapping.strategy_layout(S.HYBRID_SHARD, 6, 4)


def test_torch_enum_members_are_accepted_by_name():
    assert mapping.as_enum(torch_fsdp.ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy, "s") is \
        ShardingStrategy.SHARD_GRAD_OP
    assert mapping.as_enum(torch_fsdp.BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch, "b") is \
        BackwardPrefetch.BACKWARD_PRE
    with pytest.raises(ConfigurationError, match="sharding_strategy"):
        mapping.as_enum("FULL_SHARD", ShardingStrategy, "sharding_strategy")


def test_mixed_precision_maps_root_and_inner_input_casts():
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert mapping.mixed_precision_fields(mp, is_root=True) == {
        "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": None,
        "cast_forward_inputs": True}
    assert mapping.mixed_precision_fields(mp, is_root=False)["cast_forward_inputs"] is False
    inner = MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=True, cast_root_forward_inputs=False)
    assert mapping.mixed_precision_fields(inner, is_root=False)["cast_forward_inputs"] is True
    assert mapping.mixed_precision_fields(inner, is_root=True)["cast_forward_inputs"] is False
    assert mapping.mixed_precision_fields(None, is_root=True) is None
    torch_mp = torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16)  # torch's own config object
    assert mapping.mixed_precision_fields(torch_mp, is_root=True)["param_dtype"] is torch.bfloat16


def test_arguments_that_cannot_hold_warn_exactly_once():
    sk_wrap.warned_keys.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            mapping.check_backward_prefetch(BackwardPrefetch.BACKWARD_POST)
            mapping.mixed_precision_fields(MixedPrecision(keep_low_precision_grads=True), is_root=True)
            mapping.compute_device(0) if not torch.cuda.is_available() else None
    texts = [str(w.message) for w in caught]
    assert sum("BACKWARD_POST" in t for t in texts) == 1
    assert sum("keep_low_precision_grads" in t for t in texts) == 1
    if not torch.cuda.is_available():
        assert sum("device_id=0" in t for t in texts) == 1


# --------------------------------------------------------------------------
# on ranks


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x):
        return self.blocks(self.bn(self.inp(x)) * self.scale)


def _mixed_precision():
    sk_wrap.warned_keys.clear()
    torch.manual_seed(0)
    model = WithBuffers()
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(model, mixed_precision=mp, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    seen = {}  # hooks registered after wrapping see what the module's forward sees
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.update(block_in=a[0].dtype, block_w=m.weight.dtype))
    model.bn.register_forward_pre_hook(lambda m, a: seen.update(bn_in=a[0].dtype, bn_w=m.weight.dtype))
    model.register_forward_pre_hook(lambda m, a: seen.update(root_in=a[0].dtype))
    buffer_dtype = model.scale.dtype
    out = model(torch.randn(4, 6))
    out.float().sum().backward()
    return {
        "seen": seen, "out": out.dtype, "buffer": buffer_dtype,
        "state_dict_buffer": model.state_dict()["scale"].dtype,
        "sharded_dtypes": {p.dtype for p in model.parameters()},
        "grad_dtypes": {p.grad.dtype for p in model.parameters()},
        "bn_unit": isinstance(model.bn, FSDP),
    }


def test_mixed_precision_casts_params_buffers_and_root_inputs_and_keeps_batch_norm_in_float32():
    for r in run_on_ranks(2, _mixed_precision):
        assert r["seen"]["root_in"] is torch.bfloat16  # cast_root_forward_inputs
        assert r["seen"]["block_w"] is torch.bfloat16 and r["seen"]["block_in"] is torch.bfloat16
        assert r["bn_unit"] and r["seen"]["bn_w"] is torch.float32 and r["seen"]["bn_in"] is torch.float32
        assert r["out"] is torch.bfloat16
        assert r["buffer"] is torch.bfloat16 and r["state_dict_buffer"] is torch.float32
        assert r["sharded_dtypes"] == {torch.float32} and r["grad_dtypes"] == {torch.float32}


def _offload_ignored_and_prefetch(steps):
    world = dist.get_world_size()
    model = build_transformer()
    ref = reference_losses(model, range(steps), world)
    offloaded = FSDP(model, auto_wrap_policy=POLICY, cpu_offload=CPUOffload(offload_params=True),
                     backward_prefetch=None, forward_prefetch=True, limit_all_gathers=False,
                     device_id=torch.device("cpu"))
    offload_flags = {sp.offload for sp in sharded_params_of(offloaded)}
    losses = train_steps(offloaded, torch.optim.AdamW(offloaded.parameters(), lr=1e-2), range(steps), world)
    forward_prefetch = [[s for s in layer._shard_state().forward_prefetch] == [offloaded.layers[i + 1]._shard_state()]
                        for i, layer in enumerate(offloaded.layers[:-1])]

    plain = build_transformer()
    with CollectiveCounter() as counter:
        default = FSDP(build_transformer(), auto_wrap_policy=POLICY)
        default_losses = train_steps(default, torch.optim.AdamW(default.parameters(), lr=1e-2), range(1), world)
    with CollectiveCounter() as counter_none:
        no_prefetch = FSDP(build_transformer(), auto_wrap_policy=POLICY, backward_prefetch=None)
        none_losses = train_steps(no_prefetch, torch.optim.AdamW(no_prefetch.parameters(), lr=1e-2), range(1), world)

    ignored = FSDP(plain, auto_wrap_policy=POLICY, ignored_modules=[plain.output])
    ignored_kinds = (isinstance(ignored.output.weight, DTensor), isinstance(ignored.norm.weight, DTensor))
    states = build_transformer()
    by_states = FSDP(states, ignored_states=[states.norm.weight, states.norm.bias])
    state_kinds = (isinstance(by_states.norm.weight, DTensor), isinstance(by_states.output.weight, DTensor))
    with pytest.raises(ConfigurationError, match="not both"):
        m = build_transformer()
        FSDP(m, ignored_modules=[m.norm], ignored_states=[m.output])
    return (losses, ref, offload_flags, forward_prefetch, default_losses, none_losses, dict(counter.counts),
            dict(counter_none.counts), ignored_kinds, state_kinds)


def test_cpu_offload_prefetch_flags_and_ignored_modules_and_states():
    for result in run_on_ranks(2, _offload_ignored_and_prefetch, 3):
        losses, ref, offload, fwd_prefetch, default_losses, none_losses, counts, none_counts, ign, st = result
        assert offload == {True}
        assert_close_losses(losses, ref)
        assert fwd_prefetch == [True, True]  # each block prefetches the next after the first forward
        assert none_losses == default_losses and none_counts == counts  # same work, other order
        assert ign == (False, True) and st == (False, True)


def _sync_module_states():
    rank = dist.get_rank()
    torch.manual_seed(rank)  # every rank starts from different weights
    model = Transformer(ModelArgs())
    mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = FSDP(model, auto_wrap_policy=POLICY, sync_module_states=True)
    with FSDP.summon_full_params(model, writeback=False):
        synced = {n: p.detach().clone() for n, p in model.named_parameters()}
    return mine, synced


def test_sync_module_states_broadcasts_rank0_weights_before_sharding():
    (rank0_own, synced0), (rank1_own, synced1) = run_on_ranks(2, _sync_module_states)
    assert not torch.equal(rank0_own["output.weight"], rank1_own["output.weight"])
    for name, value in rank0_own.items():
        assert torch.equal(synced0[name], value) and torch.equal(synced1[name], value), name


def _custom_policy_overrides_and_manual_nesting():
    model = build_transformer()
    policy = CustomPolicy(lambda m: {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
                          if m is model.layers[1] else isinstance(m, Block))
    model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=torch_fsdp.ShardingStrategy.FULL_SHARD)
    out = model(torch.zeros(2, 4, dtype=torch.long))
    kept = [not isinstance(layer.attention.wq.weight, DTensor) for layer in model.layers]
    out.sum().backward()

    manual = build_transformer()
    manual.layers[0] = FSDP(manual.layers[0])
    manual = FSDP(manual)
    units = [type(u).__name__ for u in FSDP.fsdp_modules(manual)]
    with pytest.raises(ConfigurationError):
        FSDP(build_transformer(), auto_wrap_policy=CustomPolicy(lambda m: {"no_such_argument": 1}
                                                                  if isinstance(m, Block) else False))
    return kept, units


def test_custom_policy_overrides_a_units_strategy_and_manual_nesting_works():
    for kept, units in run_on_ranks(2, _custom_policy_overrides_and_manual_nesting):
        assert kept == [False, True, False]
        assert units == ["FSDPTransformer", "FSDPBlock"]


def _backward_prefetch_observed():
    seen = {}
    for name, kwargs in (("pre", {}), ("none", {"backward_prefetch": None})):
        model = FSDP(build_transformer(), auto_wrap_policy=POLICY, **kwargs)
        seen[name] = []
        # when block 2's backward ends, has block 1 been all-gathered already (prefetched)?
        model.layers[2].register_full_backward_hook(lambda m, gi, go, model=model, out=seen[name]: out.append(
            sharded_params_of(model.layers[1], recurse=False)[0].is_unsharded_allocated()))
        for _ in range(2):
            model(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
    return seen


def test_backward_prefetch_none_gathers_each_block_only_at_its_own_backward():
    for seen in run_on_ranks(2, _backward_prefetch_observed):
        assert seen == {"pre": [True, True], "none": [False, False]}


def _use_orig_params_warnings():
    sk_wrap.warned_keys.clear()
    counts = []
    for kwargs in ({}, {"use_orig_params": True}, {"use_orig_params": False}, {"use_orig_params": False},
                   {"limit_all_gathers": False}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            FSDP(build_transformer(), **kwargs)
        counts.append(sum("use_orig_params" in str(w.message) for w in caught))
    return counts


def test_explicit_use_orig_params_false_warns_once_and_defaults_stay_silent():
    for counts in run_on_ranks(2, _use_orig_params_warnings):
        assert counts == [0, 0, 1, 0, 0]
