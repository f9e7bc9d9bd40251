"""What torch's ``fully_shard`` refuses, shardkit's refuses with the same builtin exception and
torch's own words first, then its own guidance: code that catches torch's error, and a search for
torch's message, keep working after ``from shardkit import fully_shard``.

Every case runs torch's ``fully_shard`` and shardkit's on the same input, on two gloo ranks.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from tests.dist import run_on_ranks
from tests.models import MLPStack

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


class _WithScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.lin = nn.Linear(3, 3)


class _Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 6).t())


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


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
        fully_shard(_WithScalar())
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
        tied = _Tied()
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

