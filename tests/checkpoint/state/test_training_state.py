"""State dicts: FQN-keyed optimizer state, fresh optimizers, full <-> sharded one tensor at a time."""

from __future__ import annotations

import torch
import torch.nn as nn

import shardkit.checkpoint as skc
from shardkit.checkpoint.geometry.boxes import local_tensor
from shardkit.checkpoint.state import training_state as sdm
from tests.support.checkpoint_helpers import (
    build_model,
    full_state,
    make_mesh,
    make_optimizer,
    mismatches,
    train,
    world,
)
from tests.support.dist import run_on_ranks


def _plain_reference(steps: int):
    model = build_model("plain", seed=0)
    opt = make_optimizer(model)
    train(model, opt, range(steps), alone=True)
    return model, opt


def _full_of_sharded(mesh_shape, rank0_only):
    model = build_model("shardkit", seed=0, mesh_shape=mesh_shape)
    opt = make_optimizer(model)
    full = skc.get_full_state_dict(model, opt, rank0_only=rank0_only)
    return full if not full else {"model": {k: v.clone() for k, v in full["model"].items()},
                                  "state": full["optim"]["state"], "groups": full["optim"]["param_groups"]}


def test_full_state_dict_of_a_sharded_model_equals_the_unsharded_model():
    reference = build_model("plain", seed=0)
    for rank0_only in (True, False):
        out = run_on_ranks(3, _full_of_sharded, None, rank0_only)
        assert all(o == {} for o in out[1:]) if rank0_only else all(o for o in out)
        full = out[0]
        assert full["model"].keys() == reference.state_dict().keys()
        assert all(torch.equal(full["model"][k], v) for k, v in reference.state_dict().items())
        # a never-stepped optimizer got zero moments and step 0, in the optimizer's own layout
        state = full["state"]["layers.0.attention.wq.weight"]
        assert not state["exp_avg"].any() and float(state["step"]) == 0.0
        assert state["exp_avg"].shape == reference.layers[0].attention.wq.weight.shape
        assert full["groups"][0]["params"][0] == "tok_embeddings.weight"


def _load_full_from_rank0(mesh_shape, steps):
    model = build_model("shardkit", seed=42, mesh_shape=mesh_shape)
    opt = make_optimizer(model)
    full, expected = {}, None
    if world()[0] == 0:  # the reference trains in the rank: same threads, same float rounding
        ref_model, ref_opt = _plain_reference(steps)
        full = skc.get_training_state(ref_model, ref_opt)
        expected = _flat_copy(full)
    skc.set_full_state_dict(model, opt, full, broadcast_from_rank0=True)
    return expected, full_state(model, opt)


def _flat_copy(sd):
    from shardkit.checkpoint.state.tree import flatten

    flat = flatten(sd)
    return {"tensors": {k: v.clone() for k, v in flat.tensors.items()}, "values": flat.values}


def test_set_full_state_dict_broadcast_from_rank0_fills_an_hsdp_model_and_optimizer():
    expected, loaded = run_on_ranks(4, _load_full_from_rank0, (2, 2), 2)[0]
    assert len(expected["tensors"]) > 100 and mismatches(expected, loaded) == []


def _load_full_everywhere(steps):
    model = build_model("shardkit", seed=42)
    opt = make_optimizer(model)
    ref_model, ref_opt = _plain_reference(steps)
    full = skc.get_training_state(ref_model, ref_opt)
    expected = _flat_copy(full)
    skc.set_full_state_dict(model, opt, full)
    return expected, full_state(model, opt)


def test_set_full_state_dict_without_broadcast_cuts_each_rank_its_shard():
    expected, loaded = run_on_ranks(2, _load_full_everywhere, 1)[0]
    assert mismatches(expected, loaded) == []


def test_initialising_a_fresh_optimizer_changes_neither_params_nor_its_first_step():
    a, b = build_model("plain", seed=3), build_model("plain", seed=3)
    opt_a, opt_b = make_optimizer(a), make_optimizer(b)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    sd = skc.get_training_state(a, opt_a)
    assert all(torch.equal(before[k], v) for k, v in a.state_dict().items())
    assert len(sd["optim"]["state"]) == len(list(a.parameters()))
    train(a, opt_a, range(1))
    train(b, opt_b, range(1))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_fqn_keyed_optimizer_state_converts_back_for_torch_load_state_dict():
    model, opt = _plain_reference(2)
    osd = sdm.live_optimizer_state(model, opt)
    clone = build_model("plain", seed=0)
    clone_opt = make_optimizer(clone)
    clone_opt.load_state_dict(sdm.to_torch_optimizer_state(clone, clone_opt, osd))
    for p, q in zip(model.parameters(), clone.parameters()):
        assert all(torch.equal(opt.state[p][k], clone_opt.state[q][k]) for k in opt.state[p])
    other = build_model("plain", seed=1)
    untouched = make_optimizer(other)
    assert sdm.live_optimizer_state(other, untouched, init_fresh=False)["state"] == {}
    assert len(untouched.state) == 0


def _gather_then_shard():
    model = build_model("shardkit", seed=5)
    opt = make_optimizer(model)
    train(model, opt, range(1))
    live = skc.get_training_state(model, opt)
    full = sdm.gather_full_state(live, rank0_only=False)
    resharded = sdm.shard_state(full, live)
    same = []
    for key, value in resharded["model"].items():
        same.append(type(value) is type(live["model"][key])
                    and torch.equal(local_tensor(value), local_tensor(live["model"][key]))
                    and local_tensor(value).data_ptr() != local_tensor(live["model"][key]).data_ptr())
    exp_avg = resharded["optim"]["state"]["output.weight"]["exp_avg"]
    same.append(exp_avg.placements == live["optim"]["state"]["output.weight"]["exp_avg"].placements)
    return all(same)


def test_gather_then_shard_state_returns_new_dtensors_equal_to_the_live_shards():
    assert all(run_on_ranks(3, _gather_then_shard))


class _GatheringWrapper(nn.Module):
    """A wrapper whose state_dict gathers (copies) unless checkpointing asks for the live tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 2)

    def state_dict(self, *args, **kwargs):  # noqa: D102
        out = super().state_dict(*args, **kwargs)
        return out if sdm.reading_live_tensors() else {k: v.clone() for k, v in out.items()}


def test_get_training_state_asks_wrappers_for_their_live_tensors(tmp_path):
    model = _GatheringWrapper()
    sd = skc.get_training_state(model)
    assert sd["model"]["inner.weight"].data_ptr() == model.inner.weight.data_ptr()
    skc.save(sd, str(tmp_path / "w"))
    fresh = _GatheringWrapper()
    target = skc.get_training_state(fresh)
    skc.load(target, str(tmp_path / "w"))
    assert torch.equal(fresh.inner.weight, model.inner.weight)  # loaded in place, not into a copy


def _relayout_cases():
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from shardkit.errors import IncompatibleStateDict

    rank = dist.get_rank()
    mesh = make_mesh((world()[1],))
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    mine = full[3 * rank:3 * rank + 3]
    like = distribute_tensor(torch.zeros(6, 4, dtype=torch.bfloat16), mesh, [Shard(0)])
    out = {}
    same = distribute_tensor(full, mesh, [Shard(0)])
    with CommDebugMode() as comm:
        out["same is value"] = sdm.relayout_like(same, like) is same
        cast = sdm.relayout_like(same, like, dtype=torch.float64)
        out["same cast"] = (cast.dtype, cast.placements == like.placements, torch.equal(cast.to_local(), mine.double()))
        cut = sdm.relayout_like(full, like)
        out["plain cut"] = (cut.dtype, cut.placements == like.placements, torch.equal(cut.to_local(), mine),
                            cut.to_local().untyped_storage().data_ptr() != full.untyped_storage().data_ptr())
        view = sdm.relayout_like(full, like, copy=False).to_local()
        out["plain view"] = view.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        out["plain like"] = sdm.relayout_like(full, torch.zeros(6, 4)) is full
        sharded = sdm.shard_full_tensor(full, like)
        wide = sdm.shard_full_tensor(full, like, dtype=torch.float32)
        out["shard_full_tensor"] = (sharded.dtype, wide.dtype, torch.equal(wide.to_local(), mine))
    out["no communication"] = comm.get_total_counts()
    other = distribute_tensor(full, mesh, [Shard(1)])
    with CommDebugMode() as comm:
        regathered = sdm.relayout_like(other, like)
    out["other layout"] = (regathered.dtype, regathered.placements == like.placements,
                           torch.equal(regathered.to_local(), mine), comm.get_total_counts() > 0)
    try:
        sdm.relayout_like(torch.zeros(5, 4), like)
    except IncompatibleStateDict as exc:
        out["mismatch"] = str(exc)
    return out


def test_relayout_like_keeps_cuts_or_gathers_and_communicates_only_for_another_layout():
    for out in run_on_ranks(2, _relayout_cases):
        assert out["same is value"] and out["plain like"] and out["plain view"]
        assert out["same cast"] == (torch.float64, True, True)
        assert out["plain cut"] == (torch.float32, True, True, True)  # the value's dtype, its own memory
        assert out["shard_full_tensor"] == (torch.bfloat16, torch.float32, True)
        assert out["no communication"] == 0
        assert out["other layout"] == (torch.float32, True, True, True)
        assert "(5, 4)" in out["mismatch"] and "(6, 4)" in out["mismatch"]


def _rank0_hyper_parameters_everywhere():
    """Rank 0 holds a full state whose Adam betas differ from the live ones; the other ranks hold nothing."""
    import torch.distributed.checkpoint.state_dict as torch_sd
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = world()[0]
    source = build_model("plain", seed=0)
    source_opt = torch.optim.AdamW(source.parameters(), lr=0.5, betas=(0.8, 0.99))
    train(source, source_opt, range(1), alone=True)
    full = skc.get_training_state(source, source_opt) if rank == 0 else {}
    out = {}
    for name, load in (("torch", lambda m, o: torch_sd.set_optimizer_state_dict(
                            m, o, full.get("optim", {}),
                            options=torch_sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))),
                       ("set_full_state_dict", lambda m, o: skc.set_full_state_dict(m, o, full,
                                                                                     broadcast_from_rank0=True))):
        model = build_model("shardkit", seed=1)
        opt = make_optimizer(model)
        load(model, opt)
        out[name] = [(g["lr"], list(g["betas"])) for g in opt.param_groups]
    out["set_full_state_dict betas type"] = type(opt.param_groups[0]["betas"]).__name__
    like = {"weight": distribute_tensor(torch.zeros(4, 2), make_mesh((world()[1],)), [Shard(0)]), "betas": (0.9, 0.9)}
    given = {"weight": torch.ones(4, 2), "betas": (0.8, 0.99)} if rank == 0 else {}
    cut = sdm.shard_state(given, like, broadcast_from_rank0=True)
    out["shard_state"] = (cut["betas"], torch.equal(cut["weight"].to_local(), torch.ones(2, 2)))
    return out


def test_broadcast_from_rank0_gives_every_rank_rank0s_tuple_hyper_parameters_as_torch():
    for out in run_on_ranks(2, _rank0_hyper_parameters_everywhere):
        assert out["set_full_state_dict"] == out["torch"] == [(0.5, [0.8, 0.99])]
        assert out["set_full_state_dict betas type"] == "tuple"  # torch's load makes it a list
        assert out["shard_state"] == ((0.8, 0.99), True)


def test_the_training_state_is_the_live_tensors_cut_from_autograd_each_a_view_of_its_own_storage():
    model = build_model("plain", seed=0)
    opt = make_optimizer(model)
    train(model, opt, range(2), alone=True)
    state = skc.get_training_state(model, opt)
    for key, param in model.named_parameters():
        taken = state["model"][key]
        assert param.requires_grad and not taken.requires_grad and taken.grad_fn is None
        assert taken.data_ptr() == param.data_ptr()  # the live weights, not a copy
    moments = [v for s in state["optim"]["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert moments and all(not m.requires_grad for m in moments)
    live = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert {m.data_ptr() for m in moments} == {v.data_ptr() for v in live}
    with torch.no_grad():  # a step after the call shows through: nothing was copied
        next(iter(model.parameters())).add_(1.0)
    first = next(iter(model.named_parameters()))
    assert torch.equal(state["model"][first[0]], first[1])
