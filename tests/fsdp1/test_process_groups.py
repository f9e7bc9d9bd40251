"""Meshes never outlive the process groups they were built on.

A job may tear its process group down and form a new one in the same process
(``destroy_process_group()`` then ``init_process_group()``, e.g. after an
elastic restart).  Models sharded afterwards must get meshes over the new
groups: neither the FSDP1 surface (one mesh per ``FullyShardedDataParallel``
call, shared by its units) nor the core's default mesh may hand back a mesh
cached before the teardown.  Four ranks, so that ``reshard_after_forward=2``
needs groups smaller than the mesh (built and cached by the core).
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from shardkit import FullyShardedDataParallel as FSDP
from shardkit import ShardingStrategy, fully_shard
from shardkit.runtime import param_groups_of
from shardkit.wrap import transformer_auto_wrap_policy
from tests.support.dist import PG_TIMEOUT_S, run_on_ranks
from tests.support.fsdp1_helpers import build_transformer, train_steps
from tests.support.models import Block

POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})


def _is_live(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` belongs to the current default process group's world."""
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, KeyError, RuntimeError):
        return False
    return True


def _losses_of_fresh_models() -> dict[str, object]:
    world = dist.get_world_size()
    out: dict[str, object] = {}
    for strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.FULL_SHARD):  # a 2-D (W, 1) mesh and a 1-D one
        model = FSDP(build_transformer(), auto_wrap_policy=POLICY, sharding_strategy=strategy)
        meshes = {id(p.device_mesh) for p in model.parameters()}
        out[strategy.name] = train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), range(2), world)
        out[strategy.name + " meshes"] = len(meshes)
    plain = build_transformer()
    for block in plain.layers:  # the core's default mesh; between forward and backward, groups of 2 ranks
        fully_shard(block, reshard_after_forward=2)
    fully_shard(plain)
    out["fully_shard"] = train_steps(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), range(2), world)
    out["default group"] = next(plain.parameters()).device_mesh.get_group(0) is dist.group.WORLD
    out["post-forward groups live"] = all(_is_live(group.post_forward_mesh.group)
                                          for block in plain.layers for group in param_groups_of(block))
    return out


def _shard_train_reinit_and_again(prefix: str):
    before = _losses_of_fresh_models()
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    after = _losses_of_fresh_models()
    return before, after


def test_models_sharded_after_a_process_group_restart_get_meshes_over_the_new_groups():
    for before, after in run_on_ranks(4, _shard_train_reinit_and_again, f"reinit-{os.getpid()}-{id(object())}/",
                                        isolated=True):
        assert before["NO_SHARD meshes"] == before["FULL_SHARD meshes"] == 1  # one mesh per FSDP call
        assert after == before  # same models, same data: bitwise the same losses over the new groups
        assert after["default group"] is True
