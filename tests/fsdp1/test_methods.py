"""FSDP1's instance methods on the shardkit core: no_sync, summon_full_params,
apply, clip_grad_norm_, and the model state-dict types."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from shardkit import (
    FullStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from shardkit import FullyShardedDataParallel as FSDP
from shardkit.errors import ConfigurationError
from shardkit.runtime import grad_norm
from shardkit.wrap import CustomPolicy, transformer_auto_wrap_policy
from tests.support.dist import run_on_ranks
from tests.support.fsdp1_helpers import (
    PER_RANK,
    CollectiveCounter,
    build_transformer,
    global_batch,
)
from tests.support.models import Block, lm_loss

POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})


def _wrapped():
    return FSDP(build_transformer(), auto_wrap_policy=POLICY)


def _full_grads(model):
    with FSDP.summon_full_params(model, with_grads=True, writeback=False):
        return {n: p.grad.clone() for n, p in model.named_parameters()}


def _no_sync_accumulation():
    """4 micro-batches (3 inside no_sync) versus one batch of 4x the size."""
    world, rank = dist.get_world_size(), dist.get_rank()
    tokens, targets = global_batch(0, world * 4)
    micro = [(tokens[i::4], targets[i::4]) for i in range(4)]  # 4 micro-batches of world*PER_RANK rows
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    accumulated = _wrapped()
    with accumulated.no_sync():
        for tok, tgt in micro[:3]:
            (lm_loss(accumulated(tok[rows]), tgt[rows]) / 4).backward()
        synced_inside = any(p.grad is not None for p in accumulated.parameters())
    tok, tgt = micro[3]
    (lm_loss(accumulated(tok[rows]), tgt[rows]) / 4).backward()

    big = _wrapped()
    big_rows = torch.cat([tok[rows] for tok, _ in micro]), torch.cat([tgt[rows] for _, tgt in micro])
    lm_loss(big(big_rows[0]), big_rows[1]).backward()
    return synced_inside, _full_grads(accumulated), _full_grads(big)


def test_no_sync_accumulation_over_four_micro_batches_equals_one_big_batch():
    for synced_inside, accumulated, big in run_on_ranks(2, _no_sync_accumulation):
        assert not synced_inside  # no sharded gradient exists before the syncing backward
        assert accumulated.keys() == big.keys()
        for name in big:
            torch.testing.assert_close(accumulated[name], big[name], rtol=1e-5, atol=1e-6, msg=name)


def _summon_writeback():
    model = _wrapped()
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    with FSDP.summon_full_params(model):
        shapes_ok = all(not isinstance(p, DTensor) and p.shape == before[n].shape
                        for n, p in model.named_parameters())
        with torch.no_grad():
            model.layers[1].feed_forward.w1.weight.add_(1.0)
            model.output.weight.mul_(2.0)
    kept = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    with FSDP.summon_full_params(model, writeback=False):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    dropped = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    with FSDP.summon_full_params(model, recurse=False, writeback=False):
        root_only = (isinstance(model.output.weight, DTensor), isinstance(model.layers[0].attention.wq.weight, DTensor))
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False, offload_to_cpu=True):
        rank0_full = not isinstance(model.output.weight, DTensor)
    model.apply(lambda m: torch.nn.init.ones_(m.weight) if isinstance(m, torch.nn.LayerNorm) else None)
    applied = model.layers[2].ffn_norm.weight.detach().full_tensor()
    all_dtensor = all(isinstance(p, DTensor) for p in model.parameters())
    return before, kept, dropped, shapes_ok, root_only, rank0_full, applied, all_dtensor


def test_summon_full_params_writeback_persists_edits_and_writeback_false_drops_them():
    for rank, result in enumerate(run_on_ranks(2, _summon_writeback)):
        before, kept, dropped, shapes_ok, root_only, rank0_full, applied, all_dtensor = result
        assert shapes_ok and all_dtensor
        w1, out = "layers.1.feed_forward.w1.weight", "output.weight"
        assert torch.equal(kept[w1], before[w1] + 1.0)
        assert torch.equal(kept[out], before[out] * 2.0)
        assert all(torch.equal(kept[n], before[n]) for n in before if n not in (w1, out))
        assert all(torch.equal(dropped[n], kept[n]) for n in kept)
        assert root_only == (False, True)  # recurse=False: the root unit's own params only
        assert rank0_full == (rank == 0)
        assert torch.equal(applied, torch.ones_like(applied))


def _summon_rejects_rank0_only_writeback():
    with pytest.raises(ConfigurationError, match="rank0_only"):
        with FSDP.summon_full_params(_wrapped(), rank0_only=True, writeback=True):
            pass
    return True


def test_summon_full_params_refuses_rank0_only_with_writeback():
    assert run_on_ranks(2, _summon_rejects_rank0_only_writeback) == [True, True]


def _clip_norm_matches_unsharded():
    world = dist.get_world_size()
    reference = build_transformer()
    tokens, targets = global_batch(3, world)
    lm_loss(reference(tokens), targets).backward()
    ref_inf = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], float("inf"))
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    model = _wrapped()
    rank = dist.get_rank()
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    lm_loss(model(tokens[rows]), targets[rows]).backward()
    inf_norm = model.clip_grad_norm_(1e9, norm_type="inf")
    norm = model.clip_grad_norm_(0.1)
    clipped = _full_grads(model)
    return ref_norm, ref_inf, norm, inf_norm, clipped, {n: p.grad for n, p in reference.named_parameters()}


def test_clip_grad_norm_returns_the_total_norm_and_clips_like_unsharded_training():
    for ref_norm, ref_inf, norm, inf_norm, clipped, ref_grads in run_on_ranks(2, _clip_norm_matches_unsharded):
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        torch.testing.assert_close(inf_norm, ref_inf, rtol=1e-6, atol=0)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(clipped[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _clip_norm_over_mixed_meshes_and_an_ignored_module():
    """Blocks FULL_SHARD, layer 0 NO_SHARD (a (W, 1) mesh), the final norm ignored
    (plain gradients); every rank trains on the same batch, so each ignored
    gradient equals the single-process one and the total norm must too."""
    reference = build_transformer()
    tokens, targets = global_batch(3, 1)
    lm_loss(reference(tokens), targets).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    model = build_transformer()
    first = model.layers[0]
    policy = CustomPolicy(lambda m: {"sharding_strategy": ShardingStrategy.NO_SHARD} if m is first
                          else isinstance(m, Block))
    model = FSDP(model, auto_wrap_policy=policy, ignored_modules=[model.norm])
    lm_loss(model(tokens), targets).backward()
    with CollectiveCounter() as comm:
        norm = model.clip_grad_norm_(0.1)
    clipped_norm = model.norm.weight.grad.clone()
    return ref_norm, norm, comm.counts["allreduce_"], clipped_norm, reference.norm.weight.grad


def test_clip_grad_norm_counts_replicas_and_ignored_gradients_once():
    for ref_norm, norm, all_reduces, clipped, ref_clipped in run_on_ranks(
            2, _clip_norm_over_mixed_meshes_and_an_ignored_module):
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        torch.testing.assert_close(clipped, ref_clipped, rtol=1e-6, atol=0)
        assert all_reduces == 1  # one for the 1-D shard group; the NO_SHARD unit's shard dim has one rank


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_clip_grad_norm_issues_the_same_operations_for_any_number_of_parameters():
    """No per-parameter norm or host copy (on CUDA each would synchronize);
    and with plain gradients the result is exactly torch's clip_grad_norm_."""
    counted = []
    for n in (3, 30):
        torch.manual_seed(n)
        params = [nn.Parameter(torch.randn(5, 4, dtype=torch.float64 if i % 3 else torch.float32))
                  for i in range(n)]
        twins = [nn.Parameter(p.detach().clone()) for p in params]
        for p, twin in zip(params, twins):
            p.grad = torch.randn_like(p)
            twin.grad = p.grad.clone()
        with _OpCounter() as counter:
            norm = grad_norm.clip_grad_norm_(params, 0.1)
        counted.append(counter.ops)
        ref = torch.nn.utils.clip_grad_norm_(twins, 0.1)
        torch.testing.assert_close(norm, ref.to(norm.dtype), rtol=1e-6, atol=0)
        for p, twin in zip(params, twins):
            torch.testing.assert_close(p.grad, twin.grad, rtol=1e-6, atol=0)
    assert counted[0] == counted[1]
    assert counted[0]["aten._foreach_norm.Scalar"] == 1 and "aten.linalg_vector_norm.default" not in counted[0]


def _state_dict_types():
    rank = dist.get_rank()
    plain = build_transformer()
    expected = {k: v.clone() for k, v in plain.state_dict().items()}
    model = _wrapped()
    default = model.state_dict()  # FSDP1's default: FULL_STATE_DICT on every rank
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        rank0 = model.state_dict()
        inside = FSDP.get_state_dict_type(model).state_dict_type
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
        sharded = {k: v.clone() for k, v in model.state_dict().items()}  # values alias the params
    after = FSDP.get_state_dict_type(model).state_dict_type
    local_keys = None
    with pytest.warns(UserWarning, match="LOCAL_STATE_DICT"):
        FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT)
    local_keys = list(model.state_dict())
    FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)

    # a FULL load of edited tensors, then a SHARDED load of DTensors
    edited = {k: v + 1 for k, v in expected.items()}
    model.load_state_dict(edited)
    reloaded = model.state_dict()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(sharded)
    back = model.state_dict()
    return {
        "default_equal": (all(torch.equal(default[k], v) for k, v in expected.items())
                          and default.keys() == expected.keys()),
        "rank0": (list(rank0) == list(expected)) if rank == 0 else rank0 == {},
        "rank0_values": all(torch.equal(rank0[k], expected[k]) for k in rank0),
        "inside": inside, "after": after,
        "sharded": all(isinstance(v, DTensor) for v in sharded.values()) and list(sharded) == list(expected),
        "local_keys": local_keys == list(expected),
        "reloaded": all(torch.equal(reloaded[k], edited[k]) for k in expected),
        "back": all(torch.equal(back[k], expected[k]) for k in expected),
    }


def test_state_dict_types_full_rank0_only_sharded_and_loads():
    for result in run_on_ranks(2, _state_dict_types):
        assert result["default_equal"] and result["rank0"] and result["rank0_values"]
        assert result["inside"] is StateDictType.FULL_STATE_DICT and result["after"] is StateDictType.FULL_STATE_DICT
        assert result["sharded"] and result["local_keys"]
        assert result["reloaded"] and result["back"]


def _checkpoint_api_sees_live_dtensors(root):
    import shardkit.checkpoint as skc

    model = _wrapped()  # state-dict type stays FSDP1's default, FULL_STATE_DICT
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = global_batch(0, dist.get_world_size())
    rows = slice(dist.get_rank() * PER_RANK, (dist.get_rank() + 1) * PER_RANK)
    lm_loss(model(tokens[rows]), targets[rows]).backward()
    optim.step()
    state = skc.get_training_state(model, optim)
    live = all(isinstance(v, DTensor) for v in state["model"].values())
    skc.save(state, root)
    fresh = FSDP(build_transformer(seed=5), auto_wrap_policy=POLICY)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    target = skc.get_training_state(fresh, fresh_optim)
    skc.load(target, root)
    skc.set_training_state(fresh, fresh_optim, target)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    return live, same, model.state_dict()["output.weight"].shape


def test_shardkit_checkpoint_api_saves_and_loads_fsdp1_models_through_live_dtensors(tmp_path):
    for live, same, full_shape in run_on_ranks(2, _checkpoint_api_sees_live_dtensors, str(tmp_path / "ckpt")):
        assert live and same
        assert tuple(full_shape) == (37, 26)  # model.state_dict() itself is still FULL


def _summon_between_forward_and_backward():
    results = []
    for summon in (False, True):
        model = FSDP(build_transformer(), auto_wrap_policy=POLICY, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
        tokens, targets = global_batch(1, dist.get_world_size())
        rows = slice(dist.get_rank() * PER_RANK, (dist.get_rank() + 1) * PER_RANK)
        loss = lm_loss(model(tokens[rows]), targets[rows])
        if summon:  # block params are still unsharded here (ZeRO-2)
            with FSDP.summon_full_params(model, writeback=False):
                shapes = [tuple(p.shape) for p in model.layers[0].parameters()]
        loss.backward()
        results.append(_full_grads(model))
    return results, shapes


def test_summon_full_params_after_a_zero2_forward_leaves_backward_intact():
    for (plain, summoned), shapes in run_on_ranks(2, _summon_between_forward_and_backward):
        assert shapes[0] == (26,)  # full LayerNorm weight
        for name in plain:
            assert torch.equal(plain[name], summoned[name]), name


def _sharded_load_across_layouts():
    source = FSDP(build_transformer(seed=4), sharding_strategy=ShardingStrategy.NO_SHARD)
    target = _wrapped()
    with FSDP.state_dict_type(source, StateDictType.SHARDED_STATE_DICT):
        sharded = source.state_dict()  # (Replicate(), Shard(0)) on a (2, 1) mesh
    with FSDP.state_dict_type(target, StateDictType.SHARDED_STATE_DICT):
        target.load_state_dict(sharded)  # into Shard(0) on a 1-D mesh
    return all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_sharded_state_dict_of_another_layout_loads():
    assert run_on_ranks(2, _sharded_load_across_layouts) == [True, True]
