"""The state ``benchmarks/checkpoint.py`` saves and loads: a LLaMA-shaped model's fp32 weights plus AdamW's two
moments, sharded ``Shard(0)`` as FSDP lays it out (or whole, for the 1-process load), and the float64 sums every
load is checked against.  ``replicated_load.py`` builds its state with these too, so both measure the same one."""

from __future__ import annotations

from typing import Any

import peers_systems as ps  # beside this file (the benchmarks put benchmarks/ on sys.path)
import torch
from torch.distributed.tensor import DTensor, Shard

from shardkit.checkpoint.geometry.boxes import shard_box
from shardkit.checkpoint.state.tree import flatten


def shapes_for(gb: float) -> dict[str, tuple[int, ...]]:
    """Model parameter shapes (dim 1024, vocab 32000) whose weights + 2 AdamW moments reach ``gb``.

    Where the two vocabulary matrices alone would pass ``gb`` (0.79 GB: a smoke run), the vocabulary shrinks
    to take half of ``gb``, so the state stays near ``gb`` plus one layer (0.12 GB)."""
    dim, ffn, vocab = 1024, 2816, 32000
    if 12 * 2 * vocab * dim > gb * 1e9:
        vocab = max(1, int(gb * 1e9 / 2 / (12 * 2 * dim)))
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, dim), "output.weight": (vocab, dim)}
    layer = 0
    while 12 * sum(torch.Size(s).numel() for s in shapes.values()) < gb * 1e9:
        for name in ("wq", "wk", "wv", "wo"):
            shapes[f"layers.{layer}.attention.{name}.weight"] = (dim, dim)
        shapes[f"layers.{layer}.feed_forward.w1.weight"] = (ffn, dim)
        shapes[f"layers.{layer}.feed_forward.w2.weight"] = (dim, ffn)
        shapes[f"layers.{layer}.attention_norm.weight"] = (dim,)
        shapes[f"layers.{layer}.ffn_norm.weight"] = (dim,)
        layer += 1
    return shapes


def build_state(shapes: dict[str, tuple[int, ...]], rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """``{"model", "optim"}`` with DTensor shards (``mesh``) or full plain tensors (``mesh is None``)."""
    gen = torch.Generator().manual_seed(1234 + rank)

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        local_shape = shape if mesh is None else shard_box(shape, (world,), (rank,), [Shard(0)])[1]
        local = torch.empty(local_shape).uniform_(-1, 1, generator=gen)
        if mesh is None:
            return local
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    model = {k: tensor(s) for k, s in shapes.items()}
    state = {k: {"exp_avg": tensor(s), "exp_avg_sq": tensor(s), "step": torch.tensor(100.0)} for k, s in shapes.items()}
    groups = [{"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "params": list(shapes)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def tensors_of(state: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    return list(flatten(state).tensors.items())


def local_sums(state: dict[str, Any]) -> dict[str, float]:
    return {k: float(ps.local(t).double().sum()) for k, t in tensors_of(state)}


def zero_state(state: dict[str, Any]) -> None:
    for _, t in tensors_of(state):
        ps.local(t).zero_()


def state_bytes(state: dict[str, Any]) -> int:
    return sum(ps.local(t).numel() * ps.local(t).element_size() for _, t in tensors_of(state))


def check_sums(state: dict[str, Any], expected: dict[str, float], what: str) -> None:
    got = local_sums(state)
    bad = [k for k, v in expected.items() if abs(got[k] - v) > 1e-6 * max(1.0, abs(v))]
    if bad:
        raise SystemExit(f"{what}: {len(bad)} tensors differ after load, e.g. {bad[:3]}")

