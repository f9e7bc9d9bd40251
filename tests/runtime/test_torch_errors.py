"""What torch's ``fully_shard`` refuses, shardkit's refuses with the same builtin exception and
torch's own words first, then its own guidance: code that catches torch's error, and a search for
torch's message, keep working after ``from shardkit import fully_shard``.  And a parameter the user
replaces between ``fully_shard`` and the first forward is taken up at lazy init, as torch takes it.

Every case runs torch's ``fully_shard`` and shardkit's on the same input, on two gloo ranks.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests.support.dist import run_on_ranks
from tests.support.models import MLPStack, TiedLinears, WithScalarParameter

# case -> the builtin torch 2.13 raises for it
TORCH_RAISES = {
    "applied_twice": AssertionError,
    "deepcopy": AssertionError,
    "module_list_without_forward": ValueError,
    "module_dict_without_forward": ValueError,
    "three_dim_mesh": ValueError,
    "two_dim_mesh_without_dim_names": AssertionError,
    "scalar_parameter": ValueError,
    "non_contiguous_parameter": NotImplementedError,
    "uneven_sharding_on_dim_1": NotImplementedError,
    "shard_dim_the_parameter_lacks": AssertionError,
    "parameters_still_on_meta_at_forward": RuntimeError,
    "parameter_shared_by_two_groups": ValueError,
    "forward_through_a_child_first": RuntimeError,
    "list_of_modules_as_root": RuntimeError,
}


class _Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 6).t())


def _misuse(case: str, fully_shard) -> None:
    """Build ``case``'s input afresh and run it through ``fully_shard`` (torch's or shardkit's)."""
    x = torch.ones(2, 5)
    if case == "applied_twice":
        model = MLPStack()
        fully_shard(model)
        fully_shard(model)
    elif case == "deepcopy":
        copy.deepcopy(fully_shard(MLPStack()))
    elif case == "module_list_without_forward":
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]))
    elif case == "module_dict_without_forward":
        fully_shard(nn.ModuleDict({"a": nn.Linear(2, 2)}))
    elif case == "three_dim_mesh":
        fully_shard(MLPStack(), mesh=init_device_mesh("cpu", (1, 1, 2)))
    elif case == "two_dim_mesh_without_dim_names":
        fully_shard(MLPStack(), mesh=init_device_mesh("cpu", (1, 2)))
    elif case == "scalar_parameter":
        fully_shard(WithScalarParameter())
    elif case == "non_contiguous_parameter":
        fully_shard(_Transposed())
    elif case == "uneven_sharding_on_dim_1":
        fully_shard(nn.Linear(7, 4), shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    elif case == "shard_dim_the_parameter_lacks":
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(2))
    elif case == "parameters_still_on_meta_at_forward":
        with torch.device("meta"):
            model = MLPStack()
        fully_shard(model)
        model(x)
    elif case == "parameter_shared_by_two_groups":
        tied = TiedLinears()
        fully_shard(tied.b)
        fully_shard(tied)
        tied(torch.ones(2, 4))
    elif case == "forward_through_a_child_first":
        model = MLPStack()
        fully_shard(model.l0)
        fully_shard(model)
        model.l0(x)
        model(x)
    elif case == "list_of_modules_as_root":
        model = MLPStack()
        fully_shard([model.l0, model.l1])
        model.l0(x)
    else:
        raise KeyError(case)


def _outcome(fn) -> dict | None:
    from shardkit.errors import ShardkitError

    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever came out
        return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
                "shardkit": isinstance(exc, ShardkitError), "message": str(exc)}
    return None


def _torch_and_shardkit_on_every_case() -> dict[str, dict[str, dict | None]]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardkit import fully_shard

    return {case: {"torch": _outcome(lambda: _misuse(case, torch_fully_shard)),
                   "shardkit": _outcome(lambda: _misuse(case, fully_shard))}
            for case in TORCH_RAISES}


@functools.lru_cache(maxsize=None)
def _outcomes_on_two_ranks() -> list[dict]:
    return run_on_ranks(2, _torch_and_shardkit_on_every_case)


@pytest.mark.parametrize("case", list(TORCH_RAISES))
def test_shardkit_raises_torchs_builtin_with_torchs_words_first(case):
    builtin = TORCH_RAISES[case].__name__
    for rank, outcomes in enumerate(_outcomes_on_two_ranks()):
        theirs, ours = outcomes[case]["torch"], outcomes[case]["shardkit"]
        assert theirs is not None and theirs["type"] == builtin, (rank, theirs)
        assert ours is not None and ours["shardkit"], (rank, ours)
        assert builtin in ours["mro"], (rank, ours["mro"])
        assert ours["message"].startswith(theirs["message"]), (rank, theirs["message"], ours["message"])
        assert len(ours["message"]) > len(theirs["message"]), "shardkit's guidance follows torch's words"


# ---------------------------------------------------------------- a parameter replaced after fully_shard


class _WithNorm(nn.Module):
    """Two layers and a norm vector the user computes from them once they are materialized;
    3 rows over 2 ranks, so the shards are uneven."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def forward(self, x):
        return self.layer2(self.layer1(x)) * self.weight_norm


def _sharded_on_meta_and_materialized(fully_shard) -> _WithNorm:
    with torch.device("meta"):
        model = _WithNorm()
    fully_shard(model.layer1)
    fully_shard(model.layer2)
    fully_shard(model)
    torch.manual_seed(0)
    full = {"layer1.weight": torch.randn(3, 3), "layer2.weight": torch.randn(3, 3)}
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in full:
                param.copy_(distribute_tensor(full[name], param.device_mesh, param.placements))
    return model


def _norm_of_layers(model: _WithNorm) -> torch.Tensor:
    with torch.no_grad():  # DTensor ops: the result is sharded as the layers' rows are
        return torch.linalg.norm(model.layer1.weight, dim=1) + torch.linalg.norm(model.layer2.weight, dim=1)


def _train_after_replacing(fully_shard) -> dict:
    model = _sharded_on_meta_and_materialized(fully_shard)
    model.weight_norm = nn.Parameter(_norm_of_layers(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()},
            "weight_norm": (isinstance(model.weight_norm, DTensor), model.weight_norm.placements)}


def _refused_replacement(fully_shard, kind: str) -> dict | None:
    model = _sharded_on_meta_and_materialized(fully_shard)
    norm = _norm_of_layers(model)
    model.weight_norm = nn.Parameter(norm.full_tensor() if kind == "plain tensor" else
                                     norm.redistribute(norm.device_mesh, [Replicate()]))
    return _outcome(lambda: model(torch.ones(2, 3)))


def _replacements_with_torch_and_shardkit() -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardkit import fully_shard

    out = {"trained": {"torch": _train_after_replacing(torch_fully_shard),
                       "shardkit": _train_after_replacing(fully_shard)}}
    for kind in ("plain tensor", "replicated DTensor"):
        out[kind] = {"torch": _refused_replacement(torch_fully_shard, kind),
                     "shardkit": _refused_replacement(fully_shard, kind)}
    return out


@functools.lru_cache(maxsize=None)
def _replacements_on_two_ranks() -> list[dict]:
    return run_on_ranks(2, _replacements_with_torch_and_shardkit)


def test_a_parameter_replaced_before_the_first_forward_trains_bitwise_as_with_torch():
    for rank, out in enumerate(_replacements_on_two_ranks()):
        theirs, ours = out["trained"]["torch"], out["trained"]["shardkit"]
        assert ours["weight_norm"] == theirs["weight_norm"] == (True, (Shard(0),))
        assert all(torch.equal(a, b) for a, b in zip(ours["losses"], theirs["losses"], strict=True)), rank
        assert list(ours["params"]) == list(theirs["params"]) == ["weight_norm", "layer1.weight", "layer2.weight"]
        for name, value in theirs["params"].items():
            assert torch.equal(ours["params"][name], value), (rank, name)


@pytest.mark.parametrize("kind, builtin", [("plain tensor", AttributeError), ("replicated DTensor", RuntimeError)])
def test_a_replacement_torch_cannot_take_is_refused_with_the_same_builtin_and_how_to_build_one(kind, builtin):
    for rank, out in enumerate(_replacements_on_two_ranks()):
        theirs, ours = out[kind]["torch"], out[kind]["shardkit"]
        assert theirs is not None and theirs["type"] == builtin.__name__, (rank, theirs)
        assert ours is not None and ours["type"] == "ReplacedParameterError" and builtin.__name__ in ours["mro"]
        assert ours["message"].startswith("parameter weight_norm was replaced by a ")
        assert "distribute_tensor(full, param.device_mesh, param.placements)" in ours["message"]


def _second_replacement_refused(fully_shard) -> dict:
    """One group owns all three parameters; ``layer1.weight`` is replaced by a good
    DTensor, then ``layer2.weight`` (later in the group) by a plain tensor."""
    torch.manual_seed(0)
    model = _WithNorm()
    fully_shard(model)
    group = fully_shard.state(model)._fsdp_param_group
    first = model.layer1.weight
    held = next(p for p in group.fsdp_params if p.sharded_param is first)
    with torch.no_grad():
        model.layer1.weight = nn.Parameter(first * 2)  # a DTensor op: same mesh, placements and shape
    model.layer2.weight = nn.Parameter(torch.ones(3, 3))
    return {"outcome": _outcome(lambda: model(torch.ones(2, 3))),
            "first still the original": held.sharded_param is first}


def _second_replacement_with_torch_and_shardkit() -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardkit import fully_shard

    return {"torch": _second_replacement_refused(torch_fully_shard),
            "shardkit": _second_replacement_refused(fully_shard)}


def test_a_refused_replacement_leaves_the_replacements_before_it_untaken():
    for rank, out in enumerate(run_on_ranks(2, _second_replacement_with_torch_and_shardkit)):
        theirs, ours = out["torch"], out["shardkit"]
        assert theirs["outcome"]["type"] == "AttributeError", (rank, theirs)
        assert ours["outcome"]["type"] == "ReplacedParameterError" and "AttributeError" in ours["outcome"]["mro"]
        assert ours["outcome"]["message"].startswith("parameter layer2.weight was replaced by a Parameter")
        assert theirs["first still the original"] is False  # torch took layer1.weight before it failed
        assert ours["first still the original"] is True
