"""FSDP1's deferred initialization: modules built on the meta device are
materialized one unit at a time, right before that unit is sharded, with
``param_init_fn`` or each module's ``reset_parameters``."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from shardkit import FullyShardedDataParallel as FSDP
from shardkit.wrap import transformer_auto_wrap_policy
from tests.support.dist import run_on_ranks
from tests.support.fsdp1_helpers import assert_close_losses, reference_losses, train_steps
from tests.support.models import Block, ModelArgs, Transformer

POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})


def _meta_and_param_init_fn():
    calls = []

    def init(module):
        calls.append(type(module).__name__)
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for name, p in module.named_parameters(recurse=False):
                p.fill_(0.25 if name == "weight" else -1.0)

    with torch.device("meta"):
        model = Transformer(ModelArgs())
    model = FSDP(model, auto_wrap_policy=POLICY, param_init_fn=init)
    none_meta = not any(p.is_meta for p in model.parameters())
    with FSDP.summon_full_params(model, writeback=False):
        values = {n: (p.min().item(), p.max().item()) for n, p in model.named_parameters()}

    with torch.device("meta"):
        reset = Transformer(ModelArgs())
    reset = FSDP(reset, auto_wrap_policy=POLICY)
    with FSDP.summon_full_params(reset, writeback=False):
        ln = (reset.layers[0].ffn_norm.weight.detach().clone(), reset.norm.bias.detach().clone())
        finite = all(torch.isfinite(p).all().item() for p in reset.parameters())
    # the materialized model trains like one process started from the same weights
    world = dist.get_world_size()
    plain = Transformer(ModelArgs())
    plain.load_state_dict(reset.state_dict())  # FULL_STATE_DICT: every rank gets the full weights
    ref = reference_losses(plain, range(3), world)
    losses = train_steps(reset, torch.optim.AdamW(reset.parameters(), lr=1e-2), range(3), world)
    return calls, none_meta, values, ln, finite, losses, ref


def test_meta_device_modules_are_materialized_per_unit_with_param_init_fn_or_reset_parameters():
    for calls, none_meta, values, ln, finite, losses, ref in run_on_ranks(2, _meta_and_param_init_fn):
        # bottom-up: each block's modules, then the root unit's (modules of sharded blocks are not revisited)
        block = ["Block", "LayerNorm", "Attention", "Linear", "Linear", "Linear", "Linear", "LayerNorm",
                 "FeedForward", "Linear", "Linear"]
        assert calls == block * 3 + ["Transformer", "Embedding", "Embedding", "ModuleList", "LayerNorm", "Linear"]
        assert none_meta
        assert all(v == ((0.25, 0.25) if n.endswith("weight") else (-1.0, -1.0)) for n, v in values.items())
        assert torch.equal(ln[0], torch.ones_like(ln[0])) and torch.equal(ln[1], torch.zeros_like(ln[1]))
        assert finite
        assert_close_losses(losses, ref)
