"""Helpers of the checkpoint tests: build sharded models, train on fixed global batches, compare states.

Resumes at another world size must see the same data: every step uses one
global batch of ``GLOBAL_BATCH`` (12, divisible by 1, 2, 3 and 4) examples and
data-parallel rank ``r`` of ``W`` trains on rows ``[r*12/W, (r+1)*12/W)`` with
the mean loss; FSDP averages gradients over ranks, so every world size
optimises the same global mean loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.support.models import ModelArgs, Transformer, lm_loss, make_batch

ARGS = ModelArgs()
GLOBAL_BATCH = 12
LR = 1e-2


def world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def make_mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def build_model(kind: str, seed: int, mesh_shape: tuple[int, ...] | None = None, args: ModelArgs = ARGS) -> nn.Module:
    """A Transformer sharded by ``kind``: ``shardkit``, ``torch`` (torch's fully_shard) or ``plain``."""
    torch.manual_seed(seed)
    model = Transformer(args)
    if kind == "plain":
        return model
    mesh = make_mesh(mesh_shape or (world()[1],))
    if kind == "shardkit":
        from shardkit import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def stepped_linear(step: int) -> nn.Module:
    """A small ``nn.Linear`` whose weights say which step saved them (weight ``step``, bias ``-step``)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    with torch.no_grad():
        model.weight.fill_(float(step))
        model.bias.fill_(-float(step))
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, *, alone: bool = False,
          args: ModelArgs = ARGS) -> list[float]:
    """Data-parallel steps on this rank's rows of each fixed global batch; global mean loss per step.

    ``alone``: train on whole batches without any collective (a plain reference inside a rank).
    """
    rank, size = (0, 1) if alone else world()
    return train_rows(model, opt, steps, args, rank, size, size)


def train_rows(model: nn.Module, opt: torch.optim.Optimizer, steps: range, args: ModelArgs, rank: int, size: int,
               ranks: int) -> list[float]:
    """Steps on data-parallel rank ``rank`` of ``size``'s rows of each fixed global batch; the loss is
    averaged over all ``ranks`` (tensor-parallel ranks of one data-parallel rank hold the same loss)."""
    per = GLOBAL_BATCH // size
    losses = []
    for step in steps:
        tokens, targets = make_batch(args, GLOBAL_BATCH, seed=step)
        rows = slice(rank * per, (rank + 1) * per)
        loss = lm_loss(model(tokens[rows]), targets[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if ranks > 1:
            dist.all_reduce(total)
        losses.append(total.item() / ranks)
    return losses


def full_state(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Rank 0: every tensor of the model/optimizer state gathered and flattened (others: {})."""
    from shardkit.checkpoint.state.full_state_dict import get_full_state_dict
    from shardkit.checkpoint.state.tree import flatten

    full = get_full_state_dict(model, opt)
    if not full:
        return {}
    flat = flatten(full)
    return {"tensors": {k: v.clone() for k, v in flat.tensors.items()}, "values": flat.values}


def mismatches(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose tensors are not bitwise equal (or missing), plus differing values."""
    bad = sorted(set(a["tensors"]) ^ set(b["tensors"]))
    for key in set(a["tensors"]) & set(b["tensors"]):
        x, y = a["tensors"][key], b["tensors"][key]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(-1).view(torch.uint8) if x.numel()
                                                                      else x, y.view(-1).view(torch.uint8)
                                                                      if y.numel() else y):
            bad.append(key)
    if a["values"] != b["values"]:
        bad.append("values")
    return bad


def rel_close(a: list[float], b: list[float], rtol: float = 1e-6) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rtol, abs_tol=0) for x, y in zip(a, b))


def save_trained_two_steps(url: str, storage_options: dict[str, Any] | None,
                           compression: str | None, args: ModelArgs = ARGS) -> dict[str, Any]:
    """On every rank: the sharded Transformer after two steps, saved to ``url``; rank 0 returns its full state."""
    import shardkit.checkpoint as skc

    model = build_model("shardkit", seed=1, args=args)
    opt = make_optimizer(model)
    train(model, opt, range(2), args=args)
    skc.save(skc.get_training_state(model, opt), url, storage_options=storage_options, compression=compression,
             chunk_bytes=4096)
    return full_state(model, opt)


def load_into_fresh(url: str, storage_options: dict[str, Any] | None, kind: str = "shardkit",
                    args: ModelArgs = ARGS) -> dict[str, Any]:
    """On every rank: a freshly initialised model and optimizer loaded from ``url``; rank 0 returns the full state."""
    import shardkit.checkpoint as skc

    model = build_model(kind, seed=99, args=args)
    opt = make_optimizer(model)
    sd = skc.get_training_state(model, opt)
    skc.load(sd, url, storage_options=storage_options)
    skc.set_training_state(model, opt, sd)
    return full_state(model, opt)
