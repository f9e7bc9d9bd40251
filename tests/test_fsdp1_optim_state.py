"""FSDP1's optimizer-state statics round-trip across world sizes: a model and
AdamW trained at 2 ranks, saved in FSDP1's full and sharded forms, continue
at 3 ranks (and in one process) with the losses of the uninterrupted run."""

from __future__ import annotations

import copy
import functools
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardkit import FullyShardedDataParallel as FSDP, OptimStateKeyType, StateDictType
from shardkit.wrap import transformer_auto_wrap_policy
from tests.dist import run_on_ranks
from tests.fsdp1_helpers import assert_close_losses, build_transformer, global_batch, train_steps
from tests.models import Block, lm_loss

POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
ROWS = 6  # divides 1, 2 and 3 ranks
LR = 1e-2


def _wrapped_with_optimizer():
    model = FSDP(build_transformer(seed=7), auto_wrap_policy=POLICY)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _save_at_two(root):
    world = dist.get_world_size()
    model, optim = _wrapped_with_optimizer()
    train_steps(model, optim, range(3), world, rows=ROWS)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full_model = model.state_dict()
    full_osd = FSDP.full_optim_state_dict(model, optim)
    if dist.get_rank() == 0:
        torch.save(full_model, os.path.join(root, "model.pt"))
        torch.save(full_osd, os.path.join(root, "optim.pt"))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)},
                 checkpoint_id=os.path.join(root, "sharded"))
    fresh_model = FSDP(build_transformer(), auto_wrap_policy=POLICY)
    fresh = FSDP.full_optim_state_dict(fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=LR))
    cont = train_steps(model, optim, range(3, 5), world, rows=ROWS)
    return cont, fresh


def _full_view(model, optim):
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        params = model.state_dict()
    osd = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    # like torch.optim's, the returned state may alias live tensors (the step count): copy it
    return params, {fqn: {k: v.clone() for k, v in values.items()} for fqn, values in osd["state"].items()}


def _load_at_three(root):
    world, rank = dist.get_world_size(), dist.get_rank()
    saved_model = torch.load(os.path.join(root, "model.pt"), weights_only=True)
    results = {}

    # scatter: only rank 0 reads the full optimizer state
    model, optim = _wrapped_with_optimizer()
    model.load_state_dict(saved_model)
    full_osd = torch.load(os.path.join(root, "optim.pt"), weights_only=True) if rank == 0 else None
    optim.load_state_dict(FSDP.scatter_full_optim_state_dict(full_osd, model, optim=optim))
    results["restored"] = _full_view(model, optim)
    results["scatter"] = train_steps(model, optim, range(3, 5), world, rows=ROWS)

    # shard: every rank reads it (no optimizer passed: ids follow model.parameters())
    model, optim = _wrapped_with_optimizer()
    model.load_state_dict(saved_model)
    full_osd = torch.load(os.path.join(root, "optim.pt"), weights_only=True)
    optim.load_state_dict(FSDP.shard_full_optim_state_dict(full_osd, model))
    results["shard"] = train_steps(model, optim, range(3, 5), world, rows=ROWS)

    # the sharded (DCP) form, into a fresh model and optimizer
    model, optim = _wrapped_with_optimizer()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=os.path.join(root, "sharded"))
        model.load_state_dict(state["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
    results["sharded"] = train_steps(model, optim, range(3, 5), world, rows=ROWS)

    # an unwrapped model's optimizer state, re-keyed by name, into the wrapped one
    plain = build_transformer(seed=7)
    plain.load_state_dict(saved_model)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=LR)
    plain_optim.load_state_dict(FSDP.rekey_optim_state_dict(full_osd, OptimStateKeyType.PARAM_ID, plain))
    by_name = FSDP.rekey_optim_state_dict(plain_optim.state_dict(), OptimStateKeyType.PARAM_NAME, plain)
    model, optim = _wrapped_with_optimizer()
    model.load_state_dict(saved_model)
    optim.load_state_dict(FSDP.shard_full_optim_state_dict(by_name, model, optim=optim))
    results["rekeyed"] = train_steps(model, optim, range(3, 5), world, rows=ROWS)
    return results


def test_full_and_sharded_optimizer_state_saved_at_two_ranks_continue_at_three(tmp_path):
    root = str(tmp_path)
    (cont, fresh), _ = run_on_ranks(2, _save_at_two, root)
    assert fresh == {"state": {}, "param_groups": fresh["param_groups"]}  # a fresh optimizer stays untouched
    saved_model = torch.load(tmp_path / "model.pt", weights_only=True)
    saved_optim = torch.load(tmp_path / "optim.pt", weights_only=True)
    assert sorted(saved_optim["state"]) == sorted(saved_model)  # keyed by FQN, every parameter
    assert saved_optim["param_groups"][0]["params"] == list(saved_model)

    for result in run_on_ranks(3, _load_at_three, root):
        params, osd = result["restored"]
        assert all(torch.equal(params[k], v) for k, v in saved_model.items())
        for fqn, values in saved_optim["state"].items():
            for key, value in values.items():
                assert torch.equal(osd[fqn][key], value), (fqn, key)
        for path in ("scatter", "shard", "sharded", "rekeyed"):
            assert_close_losses(result[path], cont)

    # one process: the full state re-keyed to IDs loads into a plain AdamW
    plain = build_transformer(seed=7)
    plain.load_state_dict(saved_model)
    optim = torch.optim.AdamW(plain.parameters(), lr=LR)
    optim.load_state_dict(FSDP.rekey_optim_state_dict(copy.deepcopy(saved_optim), OptimStateKeyType.PARAM_ID, plain))
    losses = []
    for step in range(3, 5):
        tokens, targets = global_batch(step, 1, rows=ROWS)
        optim.zero_grad(set_to_none=step % 2 == 0)
        loss = lm_loss(plain(tokens), targets)
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert_close_losses(losses, cont)


def test_rekey_optim_state_dict_both_ways_round_trips():
    model = build_transformer()
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    lm_loss(model(global_batch(0, 1)[0]), global_batch(0, 1)[1]).backward()
    optim.step()
    by_id = optim.state_dict()
    by_name = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model, optim=optim)
    names = [n for n, _ in model.named_parameters()]
    assert list(by_name["state"]) == names
    assert by_name["param_groups"][0]["params"] == sorted(names)
    assert all(by_name["state"][n]["exp_avg"] is by_id["state"][i]["exp_avg"] for i, n in enumerate(names))
    back = FSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, model)
    assert back["state"].keys() == by_id["state"].keys()
    assert back["param_groups"][0]["params"] == by_id["param_groups"][0]["params"]
    assert FSDP.rekey_optim_state_dict(back, OptimStateKeyType.PARAM_ID, model) is back


def _optim_state_dict_full_rank0_only_round_trip():
    from shardkit import FullOptimStateDictConfig, FullStateDictConfig

    world = dist.get_world_size()
    model, optim = _wrapped_with_optimizer()
    train_steps(model, optim, range(2), world, rows=ROWS)
    settings = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig(rank0_only=True))
    FSDP.set_state_dict_type(model, *settings)
    model_sd = model.state_dict()
    osd = FSDP.optim_state_dict(model, optim)  # full, on rank 0 only
    on_rank = sorted(osd["state"]) if osd else []

    fresh, fresh_optim = _wrapped_with_optimizer()
    FSDP.set_state_dict_type(fresh, *settings)
    fresh.load_state_dict(model_sd)
    fresh_optim.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_optim, osd))
    before = FSDP.full_optim_state_dict(model, optim, rank0_only=False)["state"]
    after = FSDP.full_optim_state_dict(fresh, fresh_optim, rank0_only=False)["state"]
    same = all(torch.equal(before[f][k], after[f][k]) for f in before for k in before[f])
    a = train_steps(model, optim, range(2, 3), world, rows=ROWS)
    b = train_steps(fresh, fresh_optim, range(2, 3), world, rows=ROWS)
    return on_rank, same, a, b


def test_optim_state_dict_full_rank0_only_round_trips_through_optim_state_dict_to_load():
    results = run_on_ranks(2, _optim_state_dict_full_rank0_only_round_trip)
    assert len(results[0][0]) == 44 and results[1][0] == []
    for _, same, a, b in results:
        assert same and a == b
