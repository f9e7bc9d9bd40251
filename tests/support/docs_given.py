"""What the prose around a documentation block takes as given, for ``tests/project/test_docs_code.py``.

The docs show code as a user writes it in their own training script, where
``model``, ``optimizer``, ``data`` and ``loss_fn`` already exist.  Each block
runs in a namespace built here: the usual imports and small stand-ins for
those names (the suite's tiny ``Transformer``), so the block itself runs
unchanged.  A block that defines a name itself overrides the stand-in.

Two situations the prose describes are built on request (a term of the
block's ``docs-test`` comment): ``sharded``, a model whose blocks and root went
through ``fully_shard`` with its optimizer built after; ``fsdp1``, a model
wrapped by shardkit's ``FullyShardedDataParallel`` beside the checkpoints
torch's own FSDP1 wrote (``ckpt/step-100`` through DCP, ``model.pt`` and
``optim.pt`` through ``torch.save``) and their ``shardkit convert`` outputs.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

import shardkit
import shardkit.checkpoint as skc
from shardkit import fully_shard
from tests.support.data_helpers import IndexDataset, ShardReader
from tests.support.models import TP_ARGS, Block, Transformer, lm_loss, make_batch

__all__ = ["given"]


def given(workdir: Path, terms: str = "") -> dict[str, Any]:
    """A fresh namespace for one block (or one run of consecutive blocks), working in ``workdir``."""
    torch.manual_seed(0)
    args = TP_ARGS  # heads and ffn width divide a tensor-parallel degree of 2
    model = Transformer(args)
    if "sharded" in terms.split():
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [make_batch(args, 2, seed) for seed in range(2)]
    namespace: dict[str, Any] = {}

    def train_step(*_: Any, **__: Any) -> float:
        """One step of whatever ``model`` and ``optimizer`` the block holds now; its loss."""
        tokens, targets = data[0]
        loss = lm_loss(namespace["model"](tokens), targets)
        loss.backward()
        namespace["optimizer"].step()
        namespace["optimizer"].zero_grad()
        return loss.item()

    namespace.update(
        torch=torch, nn=nn, dist=dist, itertools=itertools, shardkit=shardkit, skc=skc, fully_shard=fully_shard,
        init_device_mesh=init_device_mesh, distribute_tensor=distribute_tensor,
        Transformer=Transformer, TransformerBlock=Block, args=args,
        model=model, optimizer=optimizer, optim=optimizer, loss_fn=lm_loss, train_step=train_step,
        data=data, micro_batches=[SimpleNamespace(x=x, y=y) for x, y in data],
        full_state_dict=Transformer(args).state_dict(), sd=skc.get_training_state(model, optimizer),
        dataset=IndexDataset(512), scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=10),
        my_reader=ShardReader(), root=str(workdir / "run"), url=str(workdir / "ckpt"),
        s3_options={"anon": False},  # the user's own; credentials and endpoint come from the environment
        step=0, steps=3, epochs=1, save_every=1, dp=2, tp=2, checkpoint_dir=str(workdir / "checkpoints"),
    )
    if "fsdp1" in terms.split():
        namespace.update(_fsdp1_situation(workdir))
    return namespace


def _fsdp1_situation(workdir: Path) -> dict[str, Any]:
    """torch's FSDP1 writes its two kinds of checkpoint, ``shardkit convert`` converts them, and a shardkit
    FSDP1 model and optimizer wait to load them."""
    import functools

    import torch.distributed.checkpoint as dcp

    from shardkit import FullyShardedDataParallel as FSDP
    from shardkit import StateDictType
    from shardkit.wrap import transformer_auto_wrap_policy
    from tests.support.fsdp1_helpers import build_transformer, torch_fsdp1_writes

    torch_fsdp1_writes(str(workdir), "ckpt/step-100")
    if dist.get_rank() == 0:
        for src, dst in (("ckpt/step-100", "ckpt-sk/step-100"), ("model.pt", "model-sk"), ("optim.pt", "optim-sk")):
            skc.convert(str(workdir / src), str(workdir / dst), to="shardkit")
    dist.barrier()
    model = FSDP(build_transformer(seed=11), auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return dict(FSDP=FSDP, StateDictType=StateDictType, dcp=dcp, model=model, optim=optim, optimizer=optim)
