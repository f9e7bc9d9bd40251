"""Model and optimizer <-> FQN-keyed state dicts; full <-> sharded, one tensor at a time.

``get_state_dict(model, optimizer)`` returns::

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

The per-tensor conversions (:func:`full_to_local`, :func:`shard_full_tensor`,
:func:`gather_full_tensor`) and their tree versions (:func:`shard_state`,
:func:`gather_full_state`) are plain functions so the FSDP1 surface can build
its optimizer-state statics on them.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn

from shardkit.checkpoint.comm import Dist
from shardkit.checkpoint.flatten import restore_like
from shardkit.checkpoint.layout import is_dtensor, local_box, local_tensor
from shardkit.errors import ConfigurationError, IncompatibleStateDict

__all__ = [
    "get_state_dict", "set_state_dict", "get_model_state_dict", "get_optimizer_state_dict",
    "set_model_state_dict", "set_optimizer_state_dict", "init_optimizer_state", "param_fqns",
    "to_torch_optimizer_state", "full_to_local", "shard_full_tensor", "gather_full_tensor",
    "gather_full_state", "shard_state", "get_full_state_dict", "set_full_state_dict",
]

_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_dp_wrapped_module")


def clean_fqn(name: str) -> str:
    """Drop wrapper path parts (``torch.compile``, activation checkpointing) from an FQN."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


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
    return {id(p): clean_fqn(name) for name, p in model.named_parameters()}


# --------------------------------------------------------------------------
# model


def get_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with clean FQNs; values share storage with the model."""
    with live_tensors():
        state = model.state_dict()
    return {clean_fqn(k): v.detach() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _copy_into(target: torch.Tensor, value: Any, key: str) -> None:
    """Copy ``value`` (DTensor, full tensor or the same tensor) into ``target`` in place.

    A DTensor with the target's mesh and placements is copied shard to shard; a
    DTensor laid out otherwise is gathered (collective) and cut; a plain tensor
    is taken as the full value.  Copying a tensor onto itself is skipped.
    """
    if not isinstance(value, torch.Tensor):
        raise IncompatibleStateDict(f"{key!r}: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(target.shape):
        raise IncompatibleStateDict(f"{key!r}: shape {tuple(value.shape)} does not match {tuple(target.shape)}")
    dst = local_tensor(target)
    if is_dtensor(value) and is_dtensor(target) and value.device_mesh == target.device_mesh \
            and tuple(value.placements) == tuple(target.placements):
        src = local_tensor(value)
    elif is_dtensor(value):
        src = full_to_local(value.full_tensor(), target)
    else:
        src = full_to_local(value, target)
    if src.data_ptr() == dst.data_ptr() and src.shape == dst.shape and src.stride() == dst.stride():
        return
    with torch.no_grad():
        dst.copy_(src)


def set_model_state_dict(model: nn.Module, state_dict: dict[str, Any], *, strict: bool = True) -> None:
    """Copy ``state_dict`` into the model in place (skips values that already are the model's tensors)."""
    current = get_model_state_dict(model)
    _check_keys(set(current), set(state_dict), "model", strict)
    for key, target in current.items():
        if key in state_dict:
            _copy_into(target, state_dict[key], f"model.{key}")


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


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of a fresh optimizer without changing any parameter.

    Runs one ``step`` with every learning rate set to 0 on zero gradients
    (existing gradients are kept aside and restored).  Parameters are
    unchanged bitwise: every update is scaled by ``lr == 0``.  Step counters
    (state ``"step"``) are then reset to 0, so for the Adam family (zero
    moments, step 0) the next real step is exactly a fresh optimizer's first.
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
        for p in params:
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


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *,
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
                state[fqn] = {k: v.detach() if isinstance(v, torch.Tensor) else v
                              for k, v in optimizer.state[p].items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": groups}


def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any],
                             *, strict: bool = True) -> None:
    """Copy an FQN-keyed optimizer state into ``optimizer`` in place (hyper-parameters included)."""
    init_optimizer_state(optimizer)
    by_fqn = {fqn: p for p, fqn in ((p, param_fqns(model).get(id(p))) for g in optimizer.param_groups
                                    for p in g["params"])}
    state = osd.get("state", {})
    _check_keys({f for f, p in by_fqn.items() if optimizer.state.get(p)}, set(state), "optimizer", strict)
    for fqn, values in state.items():
        p = by_fqn.get(fqn)
        if p is None:
            continue
        current = optimizer.state[p]
        for k, v in values.items():
            if isinstance(current.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                _copy_into(current[k], v, f"optim.state.{fqn}.{k}")
            elif isinstance(v, torch.Tensor) and is_dtensor(p) and tuple(v.shape) == tuple(p.shape):
                current[k] = shard_full_tensor(v, p)
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


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` (``"optim"`` only with an optimizer); values share storage."""
    out: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        out["optim"] = get_optimizer_state_dict(model, optimizer)
    return out


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None, state_dict: dict[str, Any],
                   *, strict: bool = True) -> None:
    """Apply a state dict (e.g. one ``load`` filled) to the model and optimizer.

    Tensors that already are the live ones are skipped, so after an in-place
    ``load`` this only applies optimizer hyper-parameters and non-tensor state.
    """
    if "model" in state_dict:
        set_model_state_dict(model, state_dict["model"], strict=strict)
    elif strict:
        raise IncompatibleStateDict("state dict has no 'model' entry")
    if optimizer is not None:
        if "optim" in state_dict:
            set_optimizer_state_dict(model, optimizer, state_dict["optim"], strict=strict)
        elif strict:
            raise IncompatibleStateDict("state dict has no 'optim' entry but an optimizer was given")


# --------------------------------------------------------------------------
# full <-> sharded, one tensor at a time


def full_to_local(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that this rank holds of ``like`` (a view; ``full`` itself for plain tensors)."""
    if tuple(full.shape) != tuple(like.shape):
        raise IncompatibleStateDict(f"full tensor has shape {tuple(full.shape)}, the target {tuple(like.shape)}")
    box = local_box(like)
    if box is None or not is_dtensor(like):
        return full
    return full[tuple(slice(o, o + s) for o, s in zip(*box))]


def shard_full_tensor(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A new DTensor with ``like``'s mesh and placements holding ``full``'s values (no communication)."""
    if not is_dtensor(like):
        return full.detach().clone()
    from torch.distributed.tensor import DTensor

    local = full_to_local(full, like).to(device=local_tensor(like).device, dtype=like.dtype).contiguous().clone()
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def gather_full_tensor(tensor: torch.Tensor, *, rank0_only: bool = True,
                       cpu_offload: bool = True) -> torch.Tensor | None:
    """The full value of ``tensor`` (one all-gather for a DTensor); ``None`` off rank 0 when ``rank0_only``.

    Collective for DTensors: every rank of the mesh must call it, in the same order.
    """
    full = tensor.full_tensor() if is_dtensor(tensor) else tensor.detach()
    if rank0_only and Dist().rank != 0:
        return None
    return full.cpu() if cpu_offload else full


def _walk(tree: Any) -> Iterator[tuple[Any, Any, Any]]:
    """(container, key, value) for every leaf, in a deterministic order."""
    if isinstance(tree, dict):
        for k in tree:
            v = tree[k]
            if isinstance(v, (dict, list)):
                yield from _walk(v)
            else:
                yield tree, k, v
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            if isinstance(v, (dict, list)):
                yield from _walk(v)
            else:
                yield tree, i, v


def _copy_tree(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy_tree(v) for v in tree]
    return tree


def gather_full_state(tree: Any, *, rank0_only: bool = True, cpu_offload: bool = True) -> Any:
    """``tree`` with every tensor gathered to its full value, one tensor at a time.

    Off rank 0 with ``rank0_only`` the result is ``{}`` (the gathers still run: collective).
    """
    out = _copy_tree(tree)
    for container, key, value in list(_walk(out)):
        if isinstance(value, torch.Tensor):
            container[key] = gather_full_tensor(value, rank0_only=rank0_only, cpu_offload=cpu_offload)
    if rank0_only and Dist().rank != 0:
        return {}
    return out


def shard_state(full_tree: Any, like_tree: Any, *, broadcast_from_rank0: bool = False) -> Any:
    """A copy of ``like_tree`` whose tensors hold ``full_tree``'s values, sharded like ``like_tree``.

    Each DTensor leaf of ``like_tree`` becomes a new DTensor (same mesh and
    placements) cut from the matching full tensor; plain tensors are copied.
    With ``broadcast_from_rank0`` only rank 0 needs ``full_tree``: each tensor
    is broadcast in turn (every rank must call this, in the same order).
    """
    dist = Dist()
    out = _copy_tree(like_tree)
    full_leaves = dict(_leaf_paths(full_tree)) if (not broadcast_from_rank0 or dist.rank == 0) else {}
    for path, (container, key, like) in _leaf_paths_with_slots(out):
        if not isinstance(like, torch.Tensor):
            if path in full_leaves:
                container[key] = restore_like(full_leaves[path], like)
            continue
        full = _full_for(path, like, full_leaves, broadcast_from_rank0, dist)
        container[key] = shard_full_tensor(full, like)
    if broadcast_from_rank0:
        values = dist.broadcast_json({p: v for p, v in full_leaves.items() if not isinstance(v, torch.Tensor)
                                      and _is_json_scalar(v)} if dist.rank == 0 else None)
        for path, (container, key, like) in _leaf_paths_with_slots(out):
            if not isinstance(like, torch.Tensor) and path in values:
                container[key] = restore_like(values[path], like)
    return out


def _is_json_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _full_for(path: str, like: torch.Tensor, full_leaves: dict[str, Any], broadcast: bool, dist: Dist) -> torch.Tensor:
    full = full_leaves.get(path)
    if not broadcast:
        if not isinstance(full, torch.Tensor):
            raise IncompatibleStateDict(f"{path!r} is missing from the full state dict")
        return full
    import torch.distributed as tdist

    ok = isinstance(full, torch.Tensor) and tuple(full.shape) == tuple(like.shape) if dist.rank == 0 else True
    if dist.any_failed(not ok):
        raise IncompatibleStateDict(f"{path!r}: rank 0's full state dict lacks it or has another shape")
    buf = full.to(like.dtype).contiguous() if dist.rank == 0 else torch.empty(like.shape, dtype=like.dtype)
    if dist.active:
        tdist.broadcast(buf, 0)
    return buf


def _leaf_paths(tree: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for path, (_, _, v) in _leaf_paths_with_slots(tree, prefix):
        yield path, v


def _leaf_paths_with_slots(tree: Any, prefix: str = "") -> Iterable[tuple[str, tuple[Any, Any, Any]]]:
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, (dict, list)) and (isinstance(v, dict) or any(isinstance(x, (dict, torch.Tensor)) for x in v)):
            yield from _leaf_paths_with_slots(v, path)
        else:
            yield path, (tree, k, v)


def get_full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                        rank0_only: bool = True, cpu_offload: bool = True) -> dict[str, Any]:
    """The full (unsharded) state dict, gathered one tensor at a time; ``{}`` off rank 0 when ``rank0_only``."""
    return gather_full_state(get_state_dict(model, optimizer), rank0_only=rank0_only, cpu_offload=cpu_offload)


def set_full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None, full: dict[str, Any], *,
                        broadcast_from_rank0: bool = False, strict: bool = True) -> None:
    """Load a full state dict into a (sharded) model and optimizer, one tensor at a time.

    Every rank needs ``full`` unless ``broadcast_from_rank0``, where only rank
    0's is read and each tensor is broadcast in turn.  Keys and shapes are
    checked on every rank before any tensor is written.
    """
    dist = Dist()
    live = get_state_dict(model, optimizer)
    have = {p for p, _ in _leaf_paths(live)}
    problem = None
    if not broadcast_from_rank0 or dist.rank == 0:
        given = dict(_leaf_paths(full))
        missing = sorted(have - set(given)) if strict else []
        unexpected = sorted(set(given) - have) if strict else []
        wrong = [p for p, v in _leaf_paths(live) if isinstance(v, torch.Tensor) and p in given
                 and (not isinstance(given[p], torch.Tensor) or tuple(given[p].shape) != tuple(v.shape))]
        if missing or unexpected or wrong:
            problem = f"full state dict mismatch: missing {missing[:10]}, unexpected {unexpected[:10]}, " \
                      f"wrong shape or type {wrong[:10]}"
    if dist.any_failed(problem is not None):
        raise IncompatibleStateDict(problem or "full state dict mismatch on rank 0 (see its error)")
    given = dict(_leaf_paths(full)) if (not broadcast_from_rank0 or dist.rank == 0) else {}
    for path, (container, key, like) in _leaf_paths_with_slots(live):
        if isinstance(like, torch.Tensor):
            if path in given or broadcast_from_rank0:
                value = _full_for(path, like, given, broadcast_from_rank0, dist)
                _copy_into(like, value, path)
        elif path in given:
            container[key] = restore_like(given[path], like)
    if broadcast_from_rank0:
        values = dist.broadcast_json({p: v for p, v in given.items() if not isinstance(v, torch.Tensor)
                                      and _is_json_scalar(v)} if dist.rank == 0 else None)
        for path, (container, key, like) in _leaf_paths_with_slots(live):
            if not isinstance(like, torch.Tensor) and path in values:
                container[key] = restore_like(values[path], like)
    set_state_dict(model, optimizer, live, strict=False)
