"""Shared pieces of the FSDP1 tests: a single-process reference run and the
same loop on ranks, with each rank taking its slice of one global batch."""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.models import Block, ModelArgs, Transformer, lm_loss, make_batch

ARGS = ModelArgs()
PER_RANK = 2


def build_transformer(seed: int = 0, args: ModelArgs = ARGS) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args)


def global_batch(step: int, world: int, args: ModelArgs = ARGS, rows: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch: ``rows`` rows (default ``PER_RANK * world``)."""
    return make_batch(args, rows or PER_RANK * world, seed=100 + step)


def local_batch(step: int, rank: int, world: int, args: ModelArgs = ARGS, rows: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal slice of :func:`global_batch`."""
    tokens, targets = global_batch(step, world, args, rows)
    per = tokens.shape[0] // world
    return tokens[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per]


def train_steps(model: nn.Module, optim: torch.optim.Optimizer, steps: range, world: int,
                clip: Callable[[nn.Module], object] | None = None, rows: int | None = None) -> list[float]:
    """Train on this rank's slice; return the global (mean over ranks) loss per step."""
    rank = dist.get_rank() if world > 1 else 0
    losses = []
    for step in steps:
        tokens, targets = local_batch(step, rank, world, rows=rows)
        optim.zero_grad(set_to_none=step % 2 == 0)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        if clip is not None:
            clip(model)
        optim.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def reference_losses(model: nn.Module, steps: range, world: int, lr: float = 1e-2,
                     max_norm: float | None = None, rows: int | None = None) -> list[float]:
    """The same steps in one process on the whole global batch (model is copied)."""
    model = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in steps:
        tokens, targets = global_batch(step, world, rows=rows)
        optim.zero_grad(set_to_none=step % 2 == 0)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optim.step()
        losses.append(loss.item())
    return losses


def assert_close_losses(ours: list[float], ref: list[float], rel: float = 1e-6) -> None:
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert abs(a - b) <= rel * abs(b), f"step {step}: {a!r} vs reference {b!r}"


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d collectives by op name (``allreduce_``, ``_allgather_base_``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.counts[func._opname] += 1
        return func(*args, **(kwargs or {}))


def torch_fsdp1_writes(root: str, sharded: str = "sharded") -> None:
    """torch's own FSDP1 trains two steps and writes both kinds of checkpoint under ``root``: ``sharded``
    through DCP (SHARDED_STATE_DICT, model and optimizer), ``model.pt`` and ``optim.pt`` through
    ``torch.save`` (FULL_STATE_DICT and full_optim_state_dict).  On every rank of a live process group."""
    import functools
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullStateDictConfig as TorchFullConfig
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TorchType
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

    policy = functools.partial(torch_policy, transformer_layer_cls={Block})
    model = TorchFSDP(build_transformer(seed=3), auto_wrap_policy=policy, device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optim, range(2), dist.get_world_size())
    with TorchFSDP.state_dict_type(model, TorchType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": TorchFSDP.optim_state_dict(model, optim)},
                 checkpoint_id=os.path.join(root, sharded))
    with TorchFSDP.state_dict_type(model, TorchType.FULL_STATE_DICT, TorchFullConfig(rank0_only=True)):
        full = model.state_dict()
    full_osd = TorchFSDP.full_optim_state_dict(model, optim)
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(root, "model.pt"))
        torch.save(full_osd, os.path.join(root, "optim.pt"))
    dist.barrier()
