"""``shardkit.checkpoint.state_dict`` is torch's ``torch.distributed.checkpoint.state_dict``: the same calls
on the same model give the same results, and DCP code runs unchanged with the import swapped.

Each comparison runs torch's function and ours in the same rank, on the same model: torch's own
``fully_shard`` model and shardkit's (torch's functions take any DTensor model), 2 gloo ranks.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_sd

import shardkit.checkpoint as skc
import shardkit.checkpoint.state_dict as our_sd
from shardkit.errors import ConfigurationError
from tests.support.checkpoint_helpers import build_model, make_optimizer, train, world
from tests.support.dist import run_on_ranks

Options = torch_sd.StateDictOptions
KINDS = ("torch", "shardkit")


def _trained(kind: str, seed: int = 0, steps: int = 2, frozen: str | None = None):
    model = build_model(kind, seed=seed)
    if frozen is not None:
        model.get_parameter(frozen).requires_grad_(False)
    opt = make_optimizer(model)
    train(model, opt, range(steps))
    return model, opt


def _placements(t: torch.Tensor) -> Any:
    return tuple(t.placements) if hasattr(t, "placements") else None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _differences(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Where two state dicts differ: keys (and their order), types, placements, shapes, dtypes, bytes."""
    if isinstance(theirs, dict):
        if not isinstance(ours, dict) or list(ours) != list(theirs):
            return [f"{path}: keys {list(ours) if isinstance(ours, dict) else type(ours)} != {list(theirs)}"]
        return [d for k in theirs for d in _differences(ours[k], theirs[k], f"{path}.{k}")]
    if isinstance(theirs, (list, tuple)):  # torch's full-state load turns a tuple (Adam's betas) into a list
        if not isinstance(ours, (list, tuple)) or len(ours) != len(theirs):
            return [f"{path}: {ours!r} != {theirs!r}"]
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in _differences(a, b, f"{path}[{i}]")]
    if isinstance(theirs, torch.Tensor):
        same = (type(ours) is type(theirs) and _placements(ours) == _placements(theirs)
                and ours.shape == theirs.shape and ours.dtype == theirs.dtype and ours.device == theirs.device
                and torch.equal(_local(ours), _local(theirs)))
        return [] if same else [f"{path}: tensor {type(ours).__name__} {_placements(ours)} {tuple(ours.shape)} != "
                                f"{type(theirs).__name__} {_placements(theirs)} {tuple(theirs.shape)} (or values)"]
    return [] if ours == theirs and type(ours) is type(theirs) else [f"{path}: {ours!r} != {theirs!r}"]


# --------------------------------------------------------------------------
# reading


OPTION_CASES = {
    "sharded": {},
    "full": {"full_state_dict": True},
    "full_rank0_cpu": {"full_state_dict": True, "cpu_offload": True},
    "cpu_offload": {"cpu_offload": True},
    "flat_optimizer": {"flatten_optimizer_state_dict": True},
    "frozen_ignored": {"ignore_frozen_params": True},
}


def _get_like_torch(kind: str) -> dict[str, list[str]]:
    model, opt = _trained(kind, frozen="layers.1.feed_forward.w2.weight")
    out = {}
    for name, kwargs in OPTION_CASES.items():
        options = Options(**kwargs)
        theirs = torch_sd.get_state_dict(model, opt, options=options)
        model_sd, optim_sd = our_sd.get_state_dict(model, opt, options=options)  # a tuple, as torch's
        out[name] = _differences((model_sd, optim_sd), theirs)
    model_sd, optim_sd = our_sd.get_state_dict(model, opt)
    out["unpacked"] = _differences({"model": model_sd, "optim": optim_sd},
                                   dict(zip(("model", "optim"), torch_sd.get_state_dict(model, opt))))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_get_state_dict_equals_torchs_for_every_option(kind):
    for rank, out in enumerate(run_on_ranks(2, _get_like_torch, kind)):
        assert out == {name: [] for name in [*OPTION_CASES, "unpacked"]}, rank


def _head_and_body_optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    head = [model.output.weight, model.norm.weight]
    body = [p for p in model.parameters() if all(p is not q for q in head)]
    return [torch.optim.AdamW(body, lr=1e-2), torch.optim.SGD(head, lr=0.1, momentum=0.9)]


def _optimizers_one_or_many(kind: str) -> dict[str, list[str]]:
    """Each function on its own copy of a fresh model: creating a never-stepped optimizer's state is compared too."""
    out = {}
    for name, make in (("one fresh optimizer", make_optimizer), ("two fresh optimizers", _head_and_body_optimizers)):
        results = []
        for functions in (our_sd, torch_sd):
            model = build_model(kind, seed=1)
            results.append(functions.get_optimizer_state_dict(model, make(model)))
        out[name] = _differences(*results)
    model = build_model(kind, seed=1)
    out["model only"] = _differences(our_sd.get_model_state_dict(model), torch_sd.get_model_state_dict(model))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_get_optimizer_state_dict_creates_and_combines_state_as_torch(kind):
    for out in run_on_ranks(2, _optimizers_one_or_many, kind):
        assert out == {"one fresh optimizer": [], "two fresh optimizers": [], "model only": []}


def _submodules_warning(kind: str) -> dict[str, Any]:
    model, opt = _trained(kind, steps=1)
    out = {}
    for keep in (True, False):
        options = Options(keep_submodule_prefixes=keep)
        with warnings.catch_warnings(record=True) as ours_warned:
            warnings.simplefilter("always")
            ours = our_sd.get_model_state_dict(model, submodules={model.layers[1]}, options=options)
        with warnings.catch_warnings(record=True) as torch_warned:
            warnings.simplefilter("always")
            theirs = torch_sd.get_model_state_dict(model, submodules={model.layers[1]}, options=options)
        out[keep] = (_differences(ours, theirs), [(w.category, str(w.message)) for w in ours_warned],
                     [(w.category, str(w.message)) for w in torch_warned])
    return out


def test_submodules_give_torchs_keys_and_torchs_deprecation_warning():
    for out in run_on_ranks(2, _submodules_warning, "shardkit"):
        for keep, (differences, ours_warned, torch_warned) in out.items():
            assert differences == [], keep
            assert ours_warned == torch_warned and ours_warned[0][0] is FutureWarning


# --------------------------------------------------------------------------
# loading


def _load_and_compare(kind: str, case: str) -> list[str]:
    """Load a trained model's state into fresh models with torch's function and with ours; compare them after."""
    source, source_opt = _trained(kind, seed=0, steps=2)
    full, broadcast = case in ("full", "broadcast", "flat_full"), case == "broadcast"
    results = []
    for functions in (torch_sd, our_sd):
        # torch cannot load a flat full optimizer state (a KeyError in its unflattening): it gets the nested one
        flat = case == "flat_sharded" or (case == "flat_full" and functions is our_sd)
        got = torch_sd.get_state_dict(source, source_opt, options=Options(full_state_dict=full,
                                                                          flatten_optimizer_state_dict=flat))
        if case == "broadcast" and world()[0] != 0:
            got = ({}, {})  # only rank 0 holds the checkpoint
        target = build_model(kind, seed=9)
        target_opt = make_optimizer(target)
        options = Options(full_state_dict=full, broadcast_from_rank0=broadcast, flatten_optimizer_state_dict=flat)
        if broadcast and functions is torch_sd:  # torch's set_state_dict skips the model where it is given none
            # (and hangs): with torch, load each part alone; ours takes set_state_dict as is
            functions.set_optimizer_state_dict(target, target_opt, got[1], options=options)
            returned = functions.set_model_state_dict(target, got[0], options=options)
        else:
            returned = functions.set_state_dict(target, target_opt, model_state_dict=got[0],
                                                optim_state_dict=got[1], options=options)
        results.append((returned, torch_sd.get_state_dict(target, target_opt)))
    (theirs_returned, theirs), (ours_returned, ours) = results
    same_return = type(ours_returned) is type(theirs_returned) and ours_returned == theirs_returned
    return _differences(ours, theirs) + ([] if same_return else [f"returned {ours_returned} != {theirs_returned}"])


LOAD_CASES = ("sharded", "full", "broadcast", "flat_sharded", "flat_full")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", LOAD_CASES)
def test_set_state_dict_loads_what_torchs_loads(kind, case):
    assert run_on_ranks(2, _load_and_compare, kind, case) == [[], []]


def _incompatible_keys(kind: str) -> dict[str, Any]:
    source, _ = _trained(kind, steps=1)
    partial = torch_sd.get_model_state_dict(source)
    partial.pop("norm.weight")
    partial["extra.weight"] = torch.zeros(3)
    out: dict[str, Any] = {}
    for name, functions in (("torch", torch_sd), ("ours", our_sd)):
        target = build_model(kind, seed=3)
        out[name] = functions.set_model_state_dict(target, dict(partial), options=Options(strict=False))
        loaded = torch_sd.get_model_state_dict(target)
        out[f"{name} loaded"] = {k: _local(v).clone() for k, v in loaded.items()}
        try:
            functions.set_model_state_dict(build_model(kind, seed=3), dict(partial))
        except Exception as exc:  # noqa: BLE001 - the type and wording are what is compared
            out[f"{name} strict"] = (type(exc), str(exc).splitlines()[0])
    out["same values"] = _differences(out.pop("ours loaded"), out.pop("torch loaded"))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_set_model_state_dict_returns_torchs_incompatible_keys_and_raises_its_strict_error(kind):
    for out in run_on_ranks(2, _incompatible_keys, kind):
        assert type(out["ours"]) is type(out["torch"])
        assert out["ours"] == out["torch"] == (["norm.weight"], ["extra.weight"])
        assert out["ours strict"] == out["torch strict"]
        assert issubclass(out["ours strict"][0], RuntimeError)
        assert out["same values"] == []


def _strict_optimizer_state(kind: str) -> tuple[Any, Any]:
    source, source_opt = _trained(kind, steps=1)
    osd = torch_sd.get_optimizer_state_dict(source, source_opt)
    osd["state"].pop("norm.weight")
    errors = []
    for functions in (torch_sd, our_sd):
        target = build_model(kind, seed=4)
        with pytest.raises(RuntimeError) as caught:
            functions.set_optimizer_state_dict(target, make_optimizer(target), osd)
        errors.append(str(caught.value))
    return tuple(errors)


def test_set_optimizer_state_dict_refuses_missing_state_with_torchs_error():
    for ours, theirs in run_on_ranks(2, _strict_optimizer_state, "shardkit"):
        assert ours == theirs
        assert ours.startswith("Missing optimizer state for parameter 'norm.weight' in checkpoint.")


def test_broadcast_from_rank0_without_full_state_dict_is_torchs_value_error():
    model = build_model("plain", seed=0)
    opt = make_optimizer(model)
    options = Options(broadcast_from_rank0=True)
    messages = []
    for functions in (torch_sd, our_sd):
        with pytest.raises(ValueError) as caught:
            functions.get_state_dict(model, opt, options=options)
        messages.append(str(caught.value))
        with pytest.raises(ValueError):
            functions.set_model_state_dict(model, model.state_dict(), options=options)
    assert messages[0] == messages[1] == "full_state_dict must be True when broadcast_from_rank0 is True."


def _refuse_empty_model_state_dict() -> list[str]:
    model = build_model("shardkit", seed=0)
    messages = []
    for functions in (torch_sd, our_sd):
        with pytest.raises(RuntimeError) as caught:
            functions.set_model_state_dict(model, {})
        messages.append(str(caught.value))
    return messages


def test_empty_model_state_dict_is_refused_as_torch_refuses_it():
    for theirs, ours in run_on_ranks(2, _refuse_empty_model_state_dict):
        wording = "The option indicates that model state_dict is required to save or load, but model state_dict " \
                  "is empty."
        assert theirs.startswith(wording) and ours.startswith(wording)


# --------------------------------------------------------------------------
# DCP code, unchanged, with the import swapped


def dcp_resume(state_dict_functions: Any, checkpoint: Any, kind: str, path: str) -> dict[str, Any]:
    """A DCP recipe as its users write it: save a trained model and optimizer, resume a fresh job from it."""
    get_state_dict, set_state_dict = state_dict_functions.get_state_dict, state_dict_functions.set_state_dict

    model, optimizer = _trained(kind, seed=0, steps=2)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    checkpoint.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    model = build_model(kind, seed=7)
    optimizer = make_optimizer(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    checkpoint.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(model, optimizer, range(2, 3))
    return torch_sd.get_state_dict(model, optimizer, options=Options(full_state_dict=True))


def _run_recipe_both_ways(kind: str, root: str) -> list[str]:
    theirs = dcp_resume(torch_sd, dcp, kind, f"{root}/dcp")
    ours = dcp_resume(our_sd, skc, kind, f"{root}/shardkit")
    return _differences(ours, theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_recipe_runs_unchanged_with_shardkits_imports(kind, tmp_path):
    assert run_on_ranks(2, _run_recipe_both_ways, kind, str(tmp_path)) == [[], []]


def test_save_and_load_take_dcp_checkpoint_id_or_url_but_not_both(tmp_path):
    model = build_model("plain", seed=0)
    skc.save(skc.get_training_state(model), checkpoint_id=tmp_path / "by-id")
    skc.async_save(skc.get_training_state(model), checkpoint_id=str(tmp_path / "async-by-id")).result()
    for where in ("by-id", "async-by-id"):
        fresh = build_model("plain", seed=1)
        assert skc.load(skc.get_training_state(fresh), checkpoint_id=str(tmp_path / where)) == {}
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ConfigurationError, match=r"^save\(\) got both url=.* and checkpoint_id="):
        skc.save(skc.get_training_state(model), str(tmp_path / "a"), checkpoint_id=str(tmp_path / "b"))
    with pytest.raises(ConfigurationError, match=r"^load\(\) got both url="):
        skc.load(skc.get_training_state(model), str(tmp_path / "by-id"), checkpoint_id=str(tmp_path / "by-id"))
    with pytest.raises(ConfigurationError, match=r"^load\(\) needs the checkpoint's location"):
        skc.load(skc.get_training_state(model))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_old_dict_form_names_point_to_their_new_homes():
    for old, new in (("get_state_dict", "get_training_state"), ("set_state_dict", "set_training_state")):
        with pytest.raises(AttributeError, match=rf"^shardkit.checkpoint.{old} is now {new} .*"
                                                 rf"shardkit.checkpoint.state_dict.{old}$"):
            getattr(skc, old)
