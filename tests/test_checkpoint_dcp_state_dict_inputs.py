"""``shardkit.checkpoint.state_dict`` on the inputs at its edges: calls written for shardkit's former dict form,
a state dict that JSON cannot describe on rank 0, and optimizer state that lacks some parameters.

Each case runs torch's ``torch.distributed.checkpoint.state_dict`` on the same model and input as the reference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as torch_sd

import shardkit.checkpoint.state_dict as our_sd
from tests.checkpoint_helpers import build_model, make_optimizer, train
from tests.dist import run_on_ranks

Options = torch_sd.StateDictOptions



# --------------------------------------------------------------------------
# optimizer state that lacks some parameters


def _optimizer_state_after_a_full_round_trip(kind: str) -> list[str]:
    """A frozen parameter has no optimizer state; rank 0 holds the full state dict, the other ranks ``{}``."""
    results = []
    for functions in (torch_sd, our_sd):
        model = build_model(kind, seed=0)
        model.norm.weight.requires_grad_(False)
        optimizer = make_optimizer(model)
        train(model, optimizer, range(1))
        options = Options(full_state_dict=True, cpu_offload=True)
        osd = torch_sd.get_optimizer_state_dict(model, optimizer, options=options)
        functions.set_optimizer_state_dict(model, optimizer, osd, options=options)
        results.append(functions.get_optimizer_state_dict(model, optimizer))
    theirs, ours = results
    differences = [] if list(ours["state"]) == list(theirs["state"]) else \
        [f"state keys {list(ours['state'])} != {list(theirs['state'])}"]
    for fqn, values in theirs["state"].items():
        mine = ours["state"].get(fqn, {})
        if list(mine) != list(values) or not all(torch.equal(_local(mine[k]), _local(v)) for k, v in values.items()):
            differences.append(f"state of {fqn}")
    return differences + ([] if _lists(ours["param_groups"]) == _lists(theirs["param_groups"]) else ["param_groups"])


def _lists(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch's full-state load turns a tuple hyper-parameter (Adam's betas) into a list: compare them as lists."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in group.items()} for group in groups]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def test_loading_leaves_no_empty_state_for_a_parameter_without_state_as_torch():
    assert run_on_ranks(2, _optimizer_state_after_a_full_round_trip, "plain") == [[], []]
