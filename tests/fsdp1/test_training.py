"""FullyShardedDataParallel returns the original module, sharded in place, and
trains like single-process training."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardkit import FSDPModule, ShardingStrategy, StateDictType
from shardkit import FullyShardedDataParallel as FSDP
from shardkit.wrap import transformer_auto_wrap_policy
from tests.support.dist import run_on_ranks
from tests.support.fsdp1_helpers import (
    assert_close_losses,
    build_transformer,
    reference_losses,
    train_steps,
)
from tests.support.models import Block, Transformer


def _identity_and_keys():
    model = build_transformer()
    keys = list(model.state_dict().keys())
    names = [n for n, _ in model.named_parameters()]
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    wrapped = FSDP(model, auto_wrap_policy=policy, use_orig_params=True)
    with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
        sharded_keys = list(wrapped.state_dict().keys())
    return {
        "same_object": wrapped is model,
        "is_transformer": isinstance(wrapped, Transformer),
        "is_fsdp": isinstance(wrapped, FSDP) and isinstance(wrapped, FSDPModule),
        "module_is_self": wrapped.module is wrapped,
        "blocks_are_units": [isinstance(b, FSDP) for b in wrapped.layers],
        "units": len(FSDP.fsdp_modules(wrapped)),
        "roots": [m is wrapped for m in FSDP.fsdp_modules(wrapped, root_only=True)],
        "keys_equal": keys == sharded_keys,
        "names_equal": names == [n for n, _ in wrapped.named_parameters()],
        "all_dtensor": all(isinstance(p, DTensor) for p in wrapped.parameters()),
        "type_name": type(wrapped).__name__,
        "is_root": (wrapped.check_is_root(), wrapped.layers[0].check_is_root()),
    }


def test_wrapping_returns_the_same_module_with_original_keys():
    for result in run_on_ranks(2, _identity_and_keys):
        assert result["same_object"] and result["is_transformer"] and result["is_fsdp"]
        assert result["module_is_self"]
        assert result["blocks_are_units"] == [True, True, True]
        assert result["units"] == 4 and result["roots"] == [True]
        assert result["keys_equal"] and result["names_equal"] and result["all_dtensor"]
        assert result["type_name"] == "FSDPTransformer"
        assert result["is_root"] == (True, False)


def _train_full_shard_parity(steps):
    world = dist.get_world_size()
    model = build_transformer()
    ref = reference_losses(model, range(steps), world, max_norm=0.5)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    ours = train_steps(model, optim, range(steps), world, clip=lambda m: norms.append(m.clip_grad_norm_(0.5)))
    return ours, ref, [n.item() for n in norms]


def test_full_shard_training_matches_single_process_on_three_ranks():
    for ours, ref, norms in run_on_ranks(3, _train_full_shard_parity, 4):
        assert_close_losses(ours, ref)
        assert all(n > 0.5 for n in norms)  # clipping was active


class _HasModuleAttributes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(4, 4)  # a child literally named "module"
        self.inner = nn.Sequential(nn.Linear(4, 4))
        self.inner.module = "metadata"  # a plain attribute named "module"

    def forward(self, x):
        return self.module(x) + len(self.inner.module)


def _module_attribute_names():
    model = FSDP(_HasModuleAttributes(), auto_wrap_policy=lambda module, recurse, **kw: recurse or
                 module is not None and isinstance(module, nn.Sequential))
    out = model(torch.ones(2, 4))
    plain = FSDP(nn.Linear(4, 4))
    return (isinstance(model.module, nn.Linear), model.inner.module, plain.module is plain,
            isinstance(model.inner, FSDP), tuple(out.shape))


def test_the_models_own_module_attributes_win_over_the_module_property():
    for linear_child, metadata, plain_self, inner_unit, shape in run_on_ranks(2, _module_attribute_names):
        assert linear_child and metadata == "metadata" and plain_self and inner_unit and shape == (2, 4)
