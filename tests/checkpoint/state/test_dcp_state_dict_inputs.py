"""``shardkit.checkpoint.state_dict`` on the inputs at its edges: calls written for shardkit's former dict form,
a state dict that JSON cannot describe on rank 0, and optimizer state that lacks some parameters.

Each case runs torch's ``torch.distributed.checkpoint.state_dict`` on the same model and input as the reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.state_dict as torch_sd

import shardkit.checkpoint.state_dict as our_sd
from shardkit.errors import ArgumentTypeError, IncompatibleStateDict
from tests.support.checkpoint_helpers import build_model, make_optimizer, train, world
from tests.support.dist import run_on_ranks

Options = torch_sd.StateDictOptions

# shardkit's former dict-form calls, which torch's signatures refuse, and the function each now is
FORMER_CALLS = {
    "get_state_dict(model)": (lambda f, m, o, s: f.get_state_dict(m), "get_training_state"),
    "get_state_dict(model, None)": (lambda f, m, o, s: f.get_state_dict(m, None), "get_training_state"),
    "get_state_dict(model, optimizer, trainable_only=True)":
        (lambda f, m, o, s: f.get_state_dict(m, o, trainable_only=True), "get_training_state"),
    "get_optimizer_state_dict(model, optimizer, init_fresh=False)":
        (lambda f, m, o, s: f.get_optimizer_state_dict(m, o, init_fresh=False), "live_optimizer_state"),
    "set_model_state_dict(model, state_dict, strict=False)":
        (lambda f, m, o, s: f.set_model_state_dict(m, s["model"], strict=False), "apply_model_state"),
    "set_optimizer_state_dict(model, optimizer, osd, strict=False)":
        (lambda f, m, o, s: f.set_optimizer_state_dict(m, o, s["optim"], strict=False), "apply_optimizer_state"),
    "set_state_dict(model, optimizer, state)": (lambda f, m, o, s: f.set_state_dict(m, o, s), "set_training_state"),
    "set_state_dict(model, optimizer, state, strict=False)":
        (lambda f, m, o, s: f.set_state_dict(m, o, s, strict=False), "set_training_state"),
}


@pytest.mark.parametrize("call", FORMER_CALLS)
def test_a_former_dict_form_call_is_torchs_type_error_naming_the_function_it_became(call):
    make_call, new_name = FORMER_CALLS[call]
    model = build_model("plain", seed=0)
    optimizer = make_optimizer(model)
    state = our_sd.get_training_state(model, optimizer)
    with pytest.raises(TypeError) as theirs:
        make_call(torch_sd, model, optimizer, state)
    with pytest.raises(ArgumentTypeError) as ours:
        make_call(our_sd, model, optimizer, state)
    assert str(ours.value).startswith(f"{theirs.value}. ")
    assert f" is now {new_name}" in str(ours.value)


def test_a_type_error_from_inside_a_call_that_fits_torchs_signature_stays_torchs():
    model = build_model("plain", seed=0)
    messages = []
    for functions in (torch_sd, our_sd):
        with pytest.raises(TypeError) as caught:
            functions.get_state_dict(model, 5)
        assert type(caught.value) is TypeError
        messages.append(str(caught.value))
    assert messages[0] == messages[1] == "'int' object is not iterable"


# --------------------------------------------------------------------------
# a key JSON cannot carry, on rank 0 only


def _broadcast_with_key(key: Any) -> tuple[str, str]:
    """torch's ``set_model_state_dict`` fails here on rank 0 alone (``AttributeError`` for a tuple key,
    ``TypeError`` for an object key) while the other ranks succeed or time out: there is no common builtin
    to match, so ours is shardkit's ``IncompatibleStateDict`` (a ``ValueError``) on every rank."""
    model = build_model("shardkit", seed=0)
    full = torch_sd.get_model_state_dict(model, options=Options(full_state_dict=True))
    given = {**full, key: torch.zeros(2)} if world()[0] == 0 else {}
    try:
        our_sd.set_model_state_dict(model, given, options=Options(full_state_dict=True, broadcast_from_rank0=True))
    except IncompatibleStateDict as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.parametrize("key", [("layers", 0), torch.float32], ids=["tuple", "object"])
def test_a_key_rank0_cannot_send_is_one_error_on_every_rank(key):
    (rank0_kind, rank0_says), (rank1_kind, rank1_says) = run_on_ranks(2, _broadcast_with_key, key, timeout=60)
    assert rank0_kind == rank1_kind == "IncompatibleStateDict"
    assert rank0_says == f"{str(key)!r}: the key {key!r} is a {type(key).__name__}; a state dict broadcast from " \
                         "rank 0 has string or integer keys only (use the parameter's FQN)"
    assert rank1_says == f"rank 0 failed under broadcast_from_rank0: {rank0_says}"


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
