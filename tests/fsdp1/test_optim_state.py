"""FSDP1's optimizer-state statics round-trip across world sizes: a model and
AdamW trained at 2 ranks, saved in FSDP1's full and sharded forms, continue
at 3 ranks (and in one process) with the losses of the uninterrupted run.
Optimizer state keeps its own dtype, and arguments that cannot be honoured
warn once."""

from __future__ import annotations

import copy
import functools
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import shardkit.wrap as sk_wrap
from shardkit import FullyShardedDataParallel as FSDP
from shardkit import OptimStateKeyType, StateDictType
from shardkit.wrap import transformer_auto_wrap_policy
from tests.support.dist import run_on_ranks
from tests.support.fsdp1_helpers import (
    assert_close_losses,
    build_transformer,
    global_batch,
    train_steps,
)
from tests.support.models import Block, lm_loss

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
    dcp.save({"optim": FSDP.sharded_optim_state_dict(model, optim)}, checkpoint_id=os.path.join(root, "sharded_optim"))
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

    # sharded_optim_state_dict as DCP's template, then flatten_sharded_optim_state_dict
    model, optim = _wrapped_with_optimizer()
    model.load_state_dict(saved_model)
    osd = FSDP.sharded_optim_state_dict(model, optim)
    dcp.load({"optim": osd}, checkpoint_id=os.path.join(root, "sharded_optim"))
    optim.load_state_dict(FSDP.flatten_sharded_optim_state_dict(osd, model, optim))
    results["flatten"] = train_steps(model, optim, range(3, 5), world, rows=ROWS)

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
        for path in ("scatter", "shard", "sharded", "flatten", "rekeyed"):
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


# --------------------------------------------------------------------------
# state dtypes, and the arguments that are not honoured


class _Fp32MomentumSGD(torch.optim.Optimizer):
    """SGD whose momentum stays float32 whatever the parameter's dtype, as
    mixed-precision optimizers keep their moments."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    momentum = self.state[p].setdefault("momentum", torch.zeros_like(p, dtype=torch.float32))
                    momentum.mul_(0.9).add_(p.grad.float())
                    p.add_(momentum.to(p.dtype), alpha=-group["lr"])


def _bf16_with_fp32_momentum():
    model = FSDP(build_transformer(seed=7).to(torch.bfloat16), auto_wrap_policy=POLICY)
    return model, _Fp32MomentumSGD(model.parameters())


def _state_keeps_its_dtype():
    rank = dist.get_rank()
    model, optim = _bf16_with_fp32_momentum()
    train_steps(model, optim, range(1), dist.get_world_size(), rows=ROWS)
    full = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    sharded = FSDP.sharded_optim_state_dict(model, optim)
    target, target_optim = _bf16_with_fp32_momentum()  # no state yet: every form is cut from the full values
    loadable = {
        "shard_full": FSDP.shard_full_optim_state_dict(full, target, optim=target_optim),
        "scatter_full": FSDP.scatter_full_optim_state_dict(full if rank == 0 else None, target, optim=target_optim),
        "flatten_full": FSDP.flatten_sharded_optim_state_dict(full, target, target_optim),
        "flatten_sharded": FSDP.flatten_sharded_optim_state_dict(sharded, target, target_optim),
    }
    out = {"full": {v["momentum"].dtype for v in full["state"].values()},
           "sharded": {v["momentum"].dtype for v in sharded["state"].values()}}
    for name, osd in loadable.items():
        by_name = FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, target, optim=target_optim)
        moments = {fqn: v["momentum"] for fqn, v in by_name["state"].items()}
        out[name] = ({m.dtype for m in moments.values()},
                     all(isinstance(m, DTensor) and torch.equal(m.full_tensor(), full["state"][fqn]["momentum"])
                         for fqn, m in moments.items()),
                     sorted(moments) == sorted(full["state"]))
    return out


def test_optimizer_state_keeps_its_own_dtype_through_every_static():
    """fp32 moments of bf16 parameters stay fp32 (and bitwise) in the full, sharded
    and loadable forms.  (torch's ``Optimizer.load_state_dict`` itself then casts
    floating state to the parameter's dtype; these functions do not.)"""
    for out in run_on_ranks(2, _state_keeps_its_dtype):
        assert out.pop("full") == {torch.float32} and out.pop("sharded") == {torch.float32}
        for name, (dtypes, equal, complete) in out.items():
            assert dtypes == {torch.float32} and equal and complete, name


def _ignored_arguments_warn_once():
    sk_wrap.warned_keys.clear()
    model, optim = _wrapped_with_optimizer()
    train_steps(model, optim, range(1), dist.get_world_size(), rows=ROWS)
    part = dist.new_group([0])  # every rank creates it; the model is sharded over both ranks
    counts = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            FSDP.full_optim_state_dict(model, optim, group=dist.group.WORLD)  # the model's own ranks: honoured
        counts["whole world"] = len(caught)
        for _ in range(2):
            full = FSDP.full_optim_state_dict(model, optim, group=part)
            FSDP.full_optim_state_dict(model, optim, optim_input=list(model.parameters()))
            sharded = FSDP.sharded_optim_state_dict(model, optim, group=part)
            FSDP.scatter_full_optim_state_dict(full or None, model, optim=optim, group=part)
            FSDP.optim_state_dict(model, optim, group=part)
            FSDP.optim_state_dict_to_load(model, optim, sharded, group=part)
    texts = [str(w.message) for w in caught]
    for function in ("full_optim_state_dict", "sharded_optim_state_dict", "scatter_full_optim_state_dict",
                     "optim_state_dict", "optim_state_dict_to_load"):
        counts[function] = sum(t.startswith(f"{function}(group=") for t in texts)
    counts["optim_input"] = sum("optim_input" in t for t in texts)
    return counts


def test_group_and_optim_input_that_are_not_honoured_warn_once_each():
    for counts in run_on_ranks(2, _ignored_arguments_warn_once):
        assert counts == {"whole world": 0, "full_optim_state_dict": 1, "sharded_optim_state_dict": 1,
                          "scatter_full_optim_state_dict": 1, "optim_state_dict": 1, "optim_state_dict_to_load": 1,
                          "optim_input": 1}
