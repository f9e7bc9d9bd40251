"""A DCP checkpoint written by torch's own ``fully_shard`` + ``dcp.save`` at 2 ranks, made once per run.

Several offline-format tests read it (bitwise reads, conversion, verify,
``dcp.load`` of our output); training a 2-rank model for each would cost a
process-group round trip per test file, so the first caller builds it in a
temporary directory and every later caller gets the same one.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from typing import Any

import torch

from tests.support.dist import run_on_ranks
from tests.support.models import lm_loss, make_batch, sharded_transformer


def flat_full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    """Flattened full (unsharded) model + optimizer state keyed like shardkit's names, and the
    FQN-keyed param_groups (empty off rank 0: cpu_offload keeps the full state there only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat = {f"model.{k}": v.clone() for k, v in msd.items()}
    if "state" not in osd:
        return flat, []
    for param, state in osd["state"].items():
        for name, value in state.items():
            flat[f"optim.state.{param}.{name}"] = value.clone()
    return flat, osd["param_groups"]


def save_with_torch_fully_shard(path: str) -> tuple[dict[str, torch.Tensor], list] | None:
    """On every rank: one AdamW step of ``Transformer`` under torch's fully_shard, then ``dcp.save``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model, optim, args = sharded_transformer(fully_shard)
    tokens, targets = make_batch(args, 2, seed=1)
    lm_loss(model(tokens), targets).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    flat, groups = flat_full_state(model, optim)
    return (flat, groups) if dist.get_rank() == 0 else None


@functools.lru_cache(maxsize=None)
def torch_fully_shard_dcp() -> tuple[str, dict[str, torch.Tensor], list[dict[str, Any]]]:
    """(path, flat full state, param_groups) of the shared torch-written DCP checkpoint.

    Treat it as read-only: copy it before damaging it.
    """
    root = tempfile.mkdtemp(prefix="shardkit-torch-dcp-")
    atexit.register(shutil.rmtree, root, True)
    path = f"{root}/fsdp2"
    flat, groups = run_on_ranks(2, save_with_torch_fully_shard, path)[0]
    return path, flat, groups
