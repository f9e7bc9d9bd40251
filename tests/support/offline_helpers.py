"""Checkpoint material for the offline-tool tests: a trained model + AdamW state, flattened, and a
checkpoint saved online by a 2-rank shardkit job (shared by the test files that need one)."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tests.support.dist import run_on_ranks
from tests.support.models import (
    ModelArgs,
    Transformer,
    lm_loss,
    make_batch,
    sharded_transformer,
)


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


EXTRA_VALUES = {"best_loss": float("inf"), "worst_loss": float("-inf"), "last_bad_loss": float("nan"), "epoch": 2}


def train_and_save_with_shardkit(path: str) -> dict[str, torch.Tensor] | None:
    """On every rank: ``Transformer`` under shardkit's ``fully_shard`` (uneven dim-0 shards), two AdamW
    steps, then ``shardkit.checkpoint.save`` with non-finite extra values; rank 0 returns the full
    flattened state (the reference every offline hop must reproduce bitwise)."""
    import torch.distributed as dist

    import shardkit.checkpoint as skc
    from shardkit import fully_shard
    from shardkit.checkpoint.state.tree import flatten

    model, optim, args = sharded_transformer(fully_shard)
    for step in range(2):
        tokens, targets = make_batch(args, 2, seed=step)
        lm_loss(model(tokens), targets).backward()
        optim.step()
        optim.zero_grad()
    state = skc.get_training_state(model, optim)
    state["extra"] = dict(EXTRA_VALUES)
    skc.save(state, path)
    full = skc.get_full_state_dict(model, optim)
    if dist.get_rank() != 0:
        return None
    return {k: v.clone() for k, v in flatten(full).tensors.items()}


@functools.lru_cache(maxsize=None)
def shardkit_two_rank_save() -> tuple[str, dict[str, torch.Tensor]]:
    """(path, full flat state) of a checkpoint saved online by 2 ranks, made once per test run.

    Read-only: copy it before changing it.
    """
    root = tempfile.mkdtemp(prefix="shardkit-online-ws2-")
    atexit.register(shutil.rmtree, root, True)
    path = f"{root}/ws2"
    return path, run_on_ranks(2, train_and_save_with_shardkit, path)[0]


def torch_and_native(root: Path) -> tuple[Path, Path]:
    """A training checkpoint (model + AdamW state) as a torch.save file and as a 2-rank native layout."""
    from shardkit.checkpoint import reshard

    flat, groups = trained_state()
    src = write_torch_state(root / "src.pt", flat, groups)
    native = root / "native"
    reshard(str(src), str(native), world_size=2)
    return src, native


def peak_rss(cmd: list[str]) -> tuple[int, int]:
    """(exit code, peak RSS bytes) of ``cmd``: its own VmHWM, sampled until it exits."""
    return peak_rss_all([cmd], at_once=1)[0]


def peak_rss_all(cmds: list[list[str]], at_once: int = 2) -> list[tuple[int, int]]:
    """(exit code, peak RSS bytes) of each command in ``cmds``, ``at_once`` of them running side by side.

    Each figure is that process's own VmHWM, sampled until it exits: a high-water mark counts the
    process's own pages only, whatever runs beside it, so independent commands need not wait for
    one another (each spends most of its time importing torch).
    """
    results: list[tuple[int, int]] = [(0, 0)] * len(cmds)
    waiting = list(enumerate(cmds))
    running: dict[int, tuple[subprocess.Popen, list[int]]] = {}
    while waiting or running:
        while waiting and len(running) < at_once:
            index, cmd = waiting.pop(0)
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=os.getcwd())
            running[index] = (proc, [0])
        for index, (proc, peak) in list(running.items()):
            if proc.poll() is not None:
                results[index] = (proc.returncode, peak[0])
                del running[index]
                continue
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            peak[0] = max(peak[0], int(line.split()[1]) * 1024)
            except OSError:
                pass
        time.sleep(0.005)
    return results


def model_and_moments(layers: int, rows: int, cols: int = 1000, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat model + optimizer-like state: ``layers`` weights of ``rows`` x ``cols`` and an exp_avg each, a
    small bias and a scalar step count -- uneven rows, so that layouts cut them unevenly."""
    gen = torch.Generator().manual_seed(seed)
    flat = {}
    for i in range(layers):
        flat[f"model.layers.{i}.w"] = torch.randn(rows, cols, generator=gen)
        flat[f"optim.state.layers.{i}.w.exp_avg"] = torch.randn(rows, cols, generator=gen)
    flat["model.bias"] = torch.randn(7, generator=gen)
    flat["optim.state.layers.0.w.step"] = torch.tensor(5.0)
    return flat
