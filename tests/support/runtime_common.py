"""Shared pieces of the sharding-core tests: the single-process reference,
data-parallel batches, and shard-vs-reference comparisons.

Data-parallel parity, made exact in the math: at step ``s`` the global batch
is ``make_batch(args, W * b, seed=s)``; rank ``r`` trains on rows
``[r*b, (r+1)*b)`` with the mean loss over its rows, and the gradients are
averaged over ranks.  The reference trains one process on the whole global
batch with the mean loss.  Both are the mean over the same ``W * b``
examples, so the two runs differ only by floating-point summation order.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests.support.models import ModelArgs, Transformer, lm_loss, make_batch

ARGS = ModelArgs()
PER_RANK_BATCH = 2
LR = 1e-2
MAX_NORM = 1.0


def seeded_transformer(seed: int = 0, args: ModelArgs = ARGS, cls: type = Transformer,
                       dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return cls(args).to(dtype)


def global_batch(step: int, world: int, args: ModelArgs = ARGS, micro: int = 0):
    return make_batch(args, world * PER_RANK_BATCH, seed=1000 * micro + step)


def local_batch(step: int, world: int, rank: int, args: ModelArgs = ARGS, micro: int = 0):
    tokens, targets = global_batch(step, world, args, micro)
    rows = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    return tokens[rows], targets[rows]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)


def train_reference(model: nn.Module, world: int, steps: int, micro_steps: int = 1,
                    set_to_none: Callable[[int], bool] = lambda step: True,
                    forward: Callable | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the global batches; returns per-step losses
    (mean over micro-steps) and the final parameters."""
    opt = make_optimizer(model)
    forward = forward or (lambda m, tokens: m(tokens))
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(micro_steps):
            tokens, targets = global_batch(step, world, micro=micro)
            loss = lm_loss(forward(model, tokens), targets)
            (loss / micro_steps).backward()
            total += loss.item() / micro_steps
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none(step))
        losses.append(total)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def train_sharded(model: nn.Module, steps: int, micro_steps: int = 1,
                  set_to_none: Callable[[int], bool] = lambda step: True,
                  forward: Callable | None = None, before_backward: Callable | None = None,
                  optimizer: torch.optim.Optimizer | None = None, sync_each_micro_step: bool = False,
                  data_parallel: tuple[int, int] | None = None, clip: Callable | None = None) -> list[float]:
    """Data-parallel training on this rank's slice of each global batch;
    returns the global mean loss per step (all-reduced).  With several
    micro-steps, gradients are synced only on the last one unless
    ``sync_each_micro_step``.

    ``data_parallel`` is ``(dp_rank, dp_size)`` when not every rank is a
    data-parallel replica (tensor-parallel peers share a batch slice); the
    loss average over all ranks is still the global mean, since each slice's
    loss is counted once per tp peer.  ``clip`` replaces
    ``torch.nn.utils.clip_grad_norm_``."""
    rank, world = data_parallel or (dist.get_rank(), dist.get_world_size())
    clip = clip or torch.nn.utils.clip_grad_norm_
    opt = optimizer or make_optimizer(model)
    forward = forward or (lambda m, tokens: m(tokens))
    losses = []
    for step in range(steps):
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(micro_steps):
            last = micro == micro_steps - 1
            if micro_steps > 1 and not sync_each_micro_step:
                model.set_requires_gradient_sync(last)
            tokens, targets = local_batch(step, world, rank, micro=micro)
            loss = lm_loss(forward(model, tokens), targets)
            if before_backward is not None:
                before_backward(model, step, micro)
            (loss / micro_steps).backward()
            total += loss.detach() / micro_steps
        clip(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none(step))
        dist.all_reduce(total)
        losses.append((total / dist.get_world_size()).item())
    return losses


def shard_blocks_and_root(model: nn.Module, **kwargs) -> nn.Module:
    from shardkit import fully_shard

    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def reference_slices_mismatch(model: nn.Module, reference: dict[str, torch.Tensor], atol: float) -> dict:
    """``{fqn: max abs error}`` of every local shard against the same slice of
    the reference tensor (``distribute_tensor``'s rule), for errors > atol.
    Also checks each shard is a DTensor with the mesh's placements."""
    bad = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is {type(param).__name__}, not a DTensor"
        expected = reference[name]
        for dim_mesh, placement in enumerate(param.placements):
            if placement.is_shard():
                size = param.device_mesh.size(dim_mesh)
                rank = param.device_mesh.get_local_rank(dim_mesh)
                chunks = torch.chunk(expected, size, dim=placement.dim)
                expected = chunks[rank] if rank < len(chunks) else expected.narrow(placement.dim, 0, 0)
        local = param.to_local()
        assert local.shape == expected.shape, (name, local.shape, expected.shape)
        err = (local - expected).abs().max().item() if local.numel() else 0.0
        if err > atol:
            bad[name] = err
    return bad


def max_relative_loss_error(losses: list[float], reference: list[float]) -> float:
    assert len(losses) == len(reference)
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def fresh_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
