"""``apply_fully_shard`` puts the core's ``fully_shard`` where an FSDP1 policy
says, bottom-up, then on the root, and the result trains like one process."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardkit import FSDPModule, FullyShardedDataParallel, MixedPrecisionPolicy
from shardkit.runtime import param_groups_of
from shardkit.wrap import (
    apply_fully_shard,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from tests.support.dist import run_on_ranks
from tests.support.fsdp1_helpers import (
    assert_close_losses,
    build_transformer,
    reference_losses,
    train_steps,
)
from tests.support.models import Block


def _apply_with_policies():
    world = dist.get_world_size()
    model = build_transformer()
    ref = reference_losses(model, range(3), world)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    out = apply_fully_shard(model, policy, reshard_after_forward=True, mp_policy=MixedPrecisionPolicy())
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    fsdp1 = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    groups = [len(param_groups_of(model.get_submodule(n))) for n in units]
    losses = train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), range(3), world)

    sized = build_transformer()
    apply_fully_shard(sized, functools.partial(size_based_auto_wrap_policy, min_num_params=2000),
                      ignored_modules=[sized.norm])
    sized_units = [n for n, m in sized.named_modules() if isinstance(m, FSDPModule)]
    norm_plain = not isinstance(sized.norm.weight, DTensor)
    return out is model, units, fsdp1, groups, losses, ref, sized_units, norm_plain


def test_apply_fully_shard_shards_policy_units_then_the_root_and_trains_like_one_process():
    for same, units, fsdp1, groups, losses, ref, sized_units, norm_plain in run_on_ranks(2, _apply_with_policies):
        assert same and not fsdp1
        assert units == ["", "layers.0", "layers.1", "layers.2"]
        assert groups == [1, 1, 1, 1]
        assert_close_losses(losses, ref)
        # size-based at 2000: attention (2730) and feed-forward (2729) modules; single linears
        # (at most 1377), blocks (left with 104 after those) and the ModuleList never
        assert sized_units == [""] + [f"layers.{i}.{m}" for i in range(3) for m in ("attention", "feed_forward")]
        assert norm_plain


def _sequential_slice_builds_an_unsharded_container():
    model = FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    part = model[0:2]
    return type(part) is nn.Sequential, isinstance(model, FullyShardedDataParallel), len(part)


def test_slicing_a_sharded_sequential_returns_a_plain_sequential():
    for is_plain, is_fsdp, length in run_on_ranks(2, _sequential_slice_builds_an_unsharded_container):
        assert is_plain and is_fsdp and length == 2
