"""Each ShardingStrategy behaves as FSDP1 documents it: what survives forward,
what is communicated, and losses equal to single-process training."""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardkit import FullyShardedDataParallel as FSDP
from shardkit import ShardingStrategy
from shardkit.runtime import sharded_params_of
from shardkit.wrap import transformer_auto_wrap_policy
from tests.support.dist import run_on_ranks
from tests.support.fsdp1_helpers import (
    CollectiveCounter,
    assert_close_losses,
    build_transformer,
    local_batch,
    reference_losses,
    train_steps,
)
from tests.support.models import Block, lm_loss

POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})


def _block_state(block, full_shapes):
    params = list(block.parameters())
    return {
        "dtensor": all(isinstance(p, DTensor) for p in params),
        "full_shape_plain": all(not isinstance(p, DTensor) and tuple(p.shape) == s
                                for p, s in zip(params, full_shapes)),
        "allocated": any(sp.is_unsharded_allocated() for sp in sharded_params_of(block, recurse=False)),
    }


def _what_survives_forward(strategy_name):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_transformer()
    shapes = [[tuple(p.shape) for p in b.parameters()] for b in model.layers]
    model = FSDP(model, auto_wrap_policy=POLICY, sharding_strategy=ShardingStrategy[strategy_name])
    tokens, targets = local_batch(0, rank, world)
    loss = lm_loss(model(tokens), targets)
    after_forward = [_block_state(b, s) for b, s in zip(model.layers, shapes)]
    loss.backward()
    after_backward = [_block_state(b, s) for b, s in zip(model.layers, shapes)]
    return after_forward, after_backward


def test_full_shard_frees_unsharded_params_after_forward():
    for after_forward, after_backward in run_on_ranks(2, _what_survives_forward, "FULL_SHARD"):
        assert after_forward == [{"dtensor": True, "full_shape_plain": False, "allocated": False}] * 3
        assert after_backward == [{"dtensor": True, "full_shape_plain": False, "allocated": False}] * 3


def test_shard_grad_op_keeps_unsharded_params_until_backward():
    for after_forward, after_backward in run_on_ranks(2, _what_survives_forward, "SHARD_GRAD_OP"):
        assert after_forward == [{"dtensor": False, "full_shape_plain": True, "allocated": True}] * 3
        assert after_backward == [{"dtensor": True, "full_shape_plain": False, "allocated": False}] * 3


def _no_shard(steps):
    world = dist.get_world_size()
    model = build_transformer()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = reference_losses(model, range(steps), world)
    model = FSDP(model, auto_wrap_policy=POLICY, sharding_strategy=ShardingStrategy.NO_SHARD)
    full_locally = all(isinstance(p, DTensor) and torch.equal(p.to_local(), full[n])
                       for n, p in model.named_parameters())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CollectiveCounter() as comm:
        losses = train_steps(model, optim, range(steps), world)
    counts = dict(comm.counts)
    placements = {p.placements for p in model.parameters()}
    after = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return losses, ref, full_locally, counts, placements, after


def test_no_shard_keeps_full_params_on_every_rank_and_all_reduces():
    results = run_on_ranks(2, _no_shard, 3)
    for losses, ref, full_locally, counts, placements, _ in results:
        assert full_locally
        assert_close_losses(losses, ref)
        assert placements == {(Replicate(), Shard(0))}
        # 4 units x 3 steps of gradient all-reduces (+1 loss all-reduce per step); nothing gathered or scattered
        assert counts.get("allreduce_", 0) == 4 * 3 + 3
        assert counts.get("_allgather_base_", 0) == 0 and counts.get("_reduce_scatter_base_", 0) == 0
    # every rank ends with the same full parameters
    for name, value in results[0][5].items():
        assert torch.equal(value, results[1][5][name]), name


def _hybrid(steps):
    world = dist.get_world_size()
    model = build_transformer()
    ref = reference_losses(model, range(steps), world)
    previous = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two "nodes" of two ranks
    try:
        hsdp = FSDP(model, auto_wrap_policy=POLICY, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = previous or str(world)
    mesh_shape = tuple(next(hsdp.parameters()).device_mesh.shape)
    losses = train_steps(hsdp, torch.optim.AdamW(hsdp.parameters(), lr=1e-2), range(steps), world)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    zero2 = FSDP(build_transformer(), auto_wrap_policy=POLICY, sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2,
                 process_group=(mesh.get_group("shard"), mesh.get_group("replicate")))
    zero2_losses = train_steps(zero2, torch.optim.AdamW(zero2.parameters(), lr=1e-2), range(steps), world)
    placements = {p.placements for p in zero2.parameters()}

    # FSDP1 takes a 2-D device_mesh without dim names as (replicate, shard)
    unnamed = FSDP(build_transformer(), auto_wrap_policy=POLICY, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                   device_mesh=init_device_mesh("cpu", (2, 2)))
    unnamed_losses = train_steps(unnamed, torch.optim.AdamW(unnamed.parameters(), lr=1e-2), range(steps), world)
    return losses, zero2_losses, unnamed_losses, ref, mesh_shape, placements


def test_hybrid_shard_on_two_by_two_ranks_matches_single_process():
    for losses, zero2_losses, unnamed_losses, ref, mesh_shape, placements in run_on_ranks(4, _hybrid, 3):
        assert mesh_shape == (2, 2)
        assert placements == {(Replicate(), Shard(0))}
        assert_close_losses(losses, ref)
        assert_close_losses(zero2_losses, ref)
        assert unnamed_losses == losses
