"""The training state: model and optimizer <-> one FQN-keyed dict of live tensors.

``get_training_state(model, optimizer)`` returns::

    {"model": {fqn: DTensor | Tensor},
     "optim": {"state": {fqn: {"step": Tensor, "exp_avg": DTensor, ...}},
               "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}]}}

The tensors are the live parameters, buffers and optimizer states themselves
(detached views), so ``load`` fills them in place and a sharded model needs no
extra memory to resume.  Optimizer state is keyed by parameter FQN, so it
reshards exactly like the weights.  A fresh optimizer that never stepped gets
its state created first (one step with learning rate 0 on zero gradients, as
torch's DCP does), so a new job has tensors to load into.

Only tensors and placements are looked at: models sharded by shardkit, by
torch's ``fully_shard``, by ``distribute_tensor`` or not at all are handled alike.

These are shardkit's own forms (the training state that ``save``/``load``
take); torch's DCP functions of the same purpose, with torch's signatures and
return types, are in :mod:`shardkit.checkpoint.state.dcp_state_dict`.

The full <-> sharded conversions live in ``relayout.py`` and are re-exported
here (:func:`full_to_local`, :func:`shard_full_tensor`, :func:`relayout_like`,
:func:`gather_full_tensor`, :func:`shard_state`, :func:`gather_full_state`):
plain functions, so the FSDP1 surface builds its optimizer-state statics on
them.  ``get_full_state_dict`` / ``set_full_state_dict`` are in
:mod:`shardkit.checkpoint.state.full_state_dict`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch
import torch.nn as nn

from shardkit.checkpoint.geometry.boxes import is_dtensor
from shardkit.checkpoint.state.relayout import (  # noqa: F401
    copy_into,
    full_to_local,
    gather_full_state,
    gather_full_tensor,
    relayout_like,
    shard_full_tensor,
    shard_state,
)
from shardkit.checkpoint.state.tree import restore_like
from shardkit.errors import ConfigurationError, IncompatibleStateDict
from shardkit.wire.fqn import eager_fqn

__all__ = [
    "get_training_state", "set_training_state", "live_model_state", "live_optimizer_state",
    "apply_model_state", "apply_optimizer_state", "init_optimizer_state", "param_fqns",
    "to_torch_optimizer_state", "full_to_local", "shard_full_tensor", "relayout_like", "gather_full_tensor",
    "gather_full_state", "shard_state",
]

_LIVE = contextvars.ContextVar("shardkit_live_state_dict", default=False)


@contextlib.contextmanager
def live_tensors() -> Iterator[None]:
    """Within this block, ``model.state_dict()`` must return the live (sharded) tensors.

    Wrappers whose ``state_dict`` gathers by default (the FSDP1 surface's
    FULL_STATE_DICT) check :func:`reading_live_tensors` and return their
    DTensors untouched, so checkpoints stay sharded and loads land in place.
    """
    token = _LIVE.set(True)
    try:
        yield
    finally:
        _LIVE.reset(token)


def reading_live_tensors() -> bool:
    return _LIVE.get()


def param_fqns(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> FQN`` (the first name of a shared parameter)."""
    return {id(p): eager_fqn(name) for name, p in model.named_parameters()}


# --------------------------------------------------------------------------
# model


def live_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with clean FQNs; values share storage with the model."""
    with live_tensors():
        state = model.state_dict()
    return {eager_fqn(k): _without_autograd(v) for k, v in state.items()}


def _without_autograd(value: Any) -> Any:
    """``value`` cut from autograd: a tensor that requires grad detached, anything else as it is.  A DTensor's
    ``detach`` goes through its dispatcher (tens of microseconds each), and the state of a training step
    (weights from ``state_dict``, optimizer moments) holds hundreds that need none: that is a save's
    blocking time, at every save."""
    return value.detach() if isinstance(value, torch.Tensor) and value.requires_grad else value


def apply_model_state(model: nn.Module, state_dict: dict[str, Any], *, strict: bool = True) -> None:
    """Copy ``state_dict`` into the model in place (skips values that already are the model's tensors)."""
    current = live_model_state(model)
    _check_keys(set(current), set(state_dict), "model", strict)
    for key, target in current.items():
        if key in state_dict:
            copy_into(target, state_dict[key], f"model.{key}")


def _check_keys(have: set[str], given: set[str], what: str, strict: bool) -> None:
    missing, unexpected = sorted(have - given), sorted(given - have)
    if strict and (missing or unexpected):
        raise IncompatibleStateDict(f"{what} state dict mismatch: missing keys {missing[:10]}"
                                    f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
                                    f"{' ...' if len(unexpected) > 10 else ''}")


# --------------------------------------------------------------------------
# optimizer


def _params_needing_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad and not optimizer.state.get(p)]


def init_optimizer_state(optimizer: torch.optim.Optimizer, *, reset_steps: bool = True) -> None:
    """Create the state of a fresh optimizer without changing any parameter.

    Runs one ``step`` with every learning rate set to 0 on zero gradients
    (existing gradients are kept aside and restored).  Parameters are
    unchanged bitwise: every update is scaled by ``lr == 0``.  Step counters
    (state ``"step"``) are then reset to 0, so for the Adam family (zero
    moments, step 0) the next real step is exactly a fresh optimizer's first;
    ``reset_steps=False`` keeps the counters at 1, as torch's DCP state-dict
    functions leave them (their drop-ins must report what torch reports).
    """
    params = _params_needing_state(optimizer)
    if not params:
        return
    saved_grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            for p in g["params"]:
                p.grad = torch.zeros_like(p) if p.requires_grad else None
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        with torch.no_grad():
            optimizer.step()
        for p in params if reset_steps else ():
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif isinstance(step, (int, float)):
                optimizer.state[p]["step"] = type(step)(0)
    finally:
        i = 0
        for g, lr in zip(optimizer.param_groups, saved_lrs):
            g["lr"] = lr
            for p in g["params"]:
                p.grad = saved_grads[i]
                i += 1


def live_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                             init_fresh: bool = True) -> dict[str, Any]:
    """``{"state": {fqn: {...}}, "param_groups": [...]}`` with live state tensors.

    ``init_fresh`` creates the state of parameters that have none yet (see
    :func:`init_optimizer_state`), so a fresh job has tensors to load into;
    ``False`` leaves the optimizer untouched and reports only existing state.
    """
    if init_fresh:
        init_optimizer_state(optimizer)
    names = param_fqns(model)
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        fqns = []
        for p in group["params"]:
            fqn = names.get(id(p))
            if fqn is None:
                raise ConfigurationError("the optimizer holds a parameter that is not in the model; build the "
                                         "optimizer from model.parameters()")
            fqns.append(fqn)
            if p in optimizer.state:
                state[fqn] = {k: _without_autograd(v) for k, v in optimizer.state[p].items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": groups}


def apply_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any],
                             *, strict: bool = True) -> None:
    """Copy an FQN-keyed optimizer state into ``optimizer`` in place (hyper-parameters included)."""
    init_optimizer_state(optimizer)
    names = param_fqns(model)  # once: it walks every parameter of the model
    by_fqn = {names.get(id(p)): p for g in optimizer.param_groups for p in g["params"]}
    state = osd.get("state", {})
    _check_keys({f for f, p in by_fqn.items() if optimizer.state.get(p)}, set(state), "optimizer", strict)
    for fqn, values in state.items():
        p = by_fqn.get(fqn)
        if p is None:
            continue
        current = optimizer.state[p]
        for k, v in values.items():
            if isinstance(current.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                copy_into(current[k], v, f"optim.state.{fqn}.{k}")
            elif isinstance(v, torch.Tensor) and is_dtensor(p) and tuple(v.shape) == tuple(p.shape):
                current[k] = relayout_like(v, p)  # keeps the state's dtype (fp32 moments of bf16 params)
            else:
                current[k] = v
    groups = osd.get("param_groups")
    if groups is not None:
        _set_param_groups(optimizer, groups, by_fqn)


def _set_param_groups(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]],
                      by_fqn: dict[str, torch.Tensor]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise IncompatibleStateDict(f"the checkpoint has {len(groups)} optimizer param groups, the optimizer has "
                                    f"{len(optimizer.param_groups)}")
    ids = {id(p): fqn for fqn, p in by_fqn.items()}
    for i, (saved, group) in enumerate(zip(groups, optimizer.param_groups)):
        have = [ids[id(p)] for p in group["params"]]
        if sorted(saved.get("params", [])) != sorted(have):
            raise IncompatibleStateDict(f"optimizer param group {i} holds different parameters in the checkpoint "
                                        f"({len(saved.get('params', []))}) and in the optimizer ({len(have)})")
        for k, v in saved.items():
            if k == "params":
                continue
            if isinstance(group.get(k), torch.Tensor) and not isinstance(v, torch.Tensor):
                group[k].fill_(v)
            else:
                group[k] = restore_like(v, group[k]) if k in group else v


def to_torch_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                             osd: dict[str, Any]) -> dict[str, Any]:
    """The dict ``optimizer.load_state_dict`` takes (integer param ids), built from an FQN-keyed one."""
    names = param_fqns(model)
    index: dict[str, int] = {}
    groups = []
    for group, saved in zip(optimizer.param_groups, osd.get("param_groups", optimizer.param_groups)):
        ids = []
        for p in group["params"]:
            index[names[id(p)]] = len(index)
            ids.append(index[names[id(p)]])
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    state = {index[fqn]: dict(values) for fqn, values in osd.get("state", {}).items() if fqn in index}
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------
# both


def get_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   trainable_only: bool = False) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` (``"optim"`` only with an optimizer); values share storage.

    ``trainable_only=True`` keeps the parameters that require grad and their
    optimizer state (e.g. LoRA adapters over a frozen base): a fine-tune's
    steps then store a few percent of the model, and loading them over a base
    checkpoint (``load(..., strict=False)``) rebuilds the whole model.
    """
    out: dict[str, Any] = {"model": live_model_state(model)}
    if optimizer is not None:
        out["optim"] = live_optimizer_state(model, optimizer)
    if trainable_only:
        trainable = {eager_fqn(n) for n, p in model.named_parameters() if p.requires_grad}
        out["model"] = {k: v for k, v in out["model"].items() if k in trainable}
        if "optim" in out:
            out["optim"]["state"] = {k: v for k, v in out["optim"]["state"].items() if k in trainable}
    return out


def set_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, state_dict: dict[str, Any],
                   *, strict: bool = True) -> None:
    """Apply a state dict (e.g. one ``load`` filled) to the model and optimizer.

    Tensors that already are the live ones are skipped, so after an in-place
    ``load`` this only applies optimizer hyper-parameters and non-tensor state.
    """
    if "model" in state_dict:
        apply_model_state(model, state_dict["model"], strict=strict)
    elif strict:
        raise IncompatibleStateDict("state dict has no 'model' entry")
    if optimizer is not None:
        if "optim" in state_dict:
            apply_optimizer_state(model, optimizer, state_dict["optim"], strict=strict)
        elif strict:
            raise IncompatibleStateDict("state dict has no 'optim' entry but an optimizer was given")
