"""Checkpoint material for the offline-tool tests: a trained model + AdamW state, flattened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models import ModelArgs, Transformer, lm_loss, make_batch


def trained_state(args: ModelArgs = ModelArgs(), seed: int = 0) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """(flat state, param_groups) of ``Transformer`` after one AdamW step, keyed like shardkit's names:
    ``model.<param>``, ``optim.state.<param>.<exp_avg|exp_avg_sq|step>``; groups list parameter names."""
    torch.manual_seed(seed)
    model = Transformer(args)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens, targets = make_batch(args, 2, seed=seed + 1)
    lm_loss(model(tokens), targets).backward()
    optim.step()
    names = {id(p): n for n, p in model.named_parameters()}
    flat = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for param, state in optim.state.items():
        for key, value in state.items():
            flat[f"optim.state.{names[id(param)]}.{key}"] = value.detach().clone()
    groups = []
    for group in optim.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [names[id(p)] for p in group["params"]]
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()})
    return flat, groups


def nest(flat: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The nested ``{"model": ..., "optim": {"state": ..., "param_groups": ...}}`` form of a flat state."""
    out: dict[str, Any] = {"model": {}, "optim": {"state": {}, "param_groups": groups}}
    for key, value in flat.items():
        if key.startswith("model."):
            out["model"][key[len("model."):]] = value
        else:
            param, _, name = key[len("optim.state."):].rpartition(".")
            out["optim"]["state"].setdefault(param, {})[name] = value
    return out


def write_torch_state(path: Path, flat: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> Path:
    torch.save(nest(flat, groups), path)
    return path
