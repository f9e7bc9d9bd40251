"""An FSDP1 training script moved onto shardkit by changing its imports.

This is the FSDP1 recipe from the usage guide: each transformer block is an
FSDP unit (``transformer_auto_wrap_policy``), bf16 ``MixedPrecision``,
``FULL_SHARD``, ``BackwardPrefetch.BACKWARD_PRE``, ``clip_grad_norm_``, a full
state dict plus ``full_optim_state_dict`` saved with ``torch.save``, and a
sharded state dict saved and loaded with ``torch.distributed.checkpoint``.
Nothing below the imports mentions shardkit: with the two torch imports
instead, it is plain torch FSDP1 code, meant to run under
``torch.distributed.fsdp`` unchanged on CUDA (not tested here: no GPU).  On a
CPU-only torch build, torch's FSDP1 crashes gathering a full state dict with
``offload_to_cpu=True``; with only that argument dropped it runs, and in fp32
its ``train``, ``continue`` and ``resume-sharded`` losses equal shardkit's
bitwise (``tests/fsdp1/test_example.py`` checks this).  Its ``resume-full``
phase differs from the second resumed step on: there (torch 2.13, CPU, gloo,
``use_orig_params=True``) torch's ``full_optim_state_dict`` returns every
``exp_avg`` equal to its ``exp_avg_sq`` (with ``use_orig_params=False`` it
does not), so the restored moments are wrong; the weights load right (the
first resumed loss matches).  shardkit's ``resume-full`` repeats ``continue``
exactly.

Run (CPU, gloo; uses CUDA/NCCL when present)::

    torchrun --nproc_per_node 2 examples/fsdp1_migration.py
    torchrun --nproc_per_node 2 examples/fsdp1_migration.py --mixed-precision none

Rank 0 prints one JSON line per step: ``{"phase": ..., "step": ..., "loss": ...}``.
The phases: ``train`` (the first steps), ``continue`` (more steps after saving
both checkpoints), ``resume-sharded`` (the same steps again after loading the
sharded checkpoint back), ``resume-full`` (the same steps in a fresh model and
optimizer loaded from the full checkpoint).  The three last phases print the
same losses.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

# --- the only lines that differ from the FSDP1 script -----------------------
from shardkit import (
    BackwardPrefetch,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from shardkit import FullyShardedDataParallel as FSDP
from shardkit.wrap import transformer_auto_wrap_policy

# ---------------------------------------------------------------------------

VOCAB, DIM, HEADS, LAYERS, SEQ = 67, 48, 4, 3, 16


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, DIM))
        return x + self.mlp(self.norm2(x))


@dataclass
class ModelOutput:
    logits: torch.Tensor
    loss: torch.Tensor


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, batch: dict[str, torch.Tensor]) -> ModelOutput:
        h = self.embed(batch["input_ids"]) + self.pos
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
        return ModelOutput(logits, loss)


def build_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def make_batch(step: int, rank: int, per_rank: int = 4) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of the global batch for ``step`` (deterministic)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, VOCAB, (per_rank, SEQ + 1), generator=gen)
    return {"input_ids": data[:, :-1], "labels": data[:, 1:]}


def wrap(model: nn.Module, mixed_precision: bool, device: torch.device) -> nn.Module:
    auto_wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                         transformer_layer_cls={TransformerBlock})
    mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                               buffer_dtype=torch.bfloat16) if mixed_precision else None
    return FSDP(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=auto_wrap_policy,
        mixed_precision=mp_policy,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=device,
        use_orig_params=True,
        limit_all_gathers=True,
    )


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, phase: str,
          device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        batch = {k: v.to(device) for k, v in make_batch(step, rank).items()}
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch).loss
        loss.backward()
        model.clip_grad_norm_(1.0)  # FSDP-aware grad clipping
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        if rank == 0:
            print(json.dumps({"phase": phase, "step": step, "loss": global_loss.item() / world}), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--resume-steps", type=int, default=2)
    parser.add_argument("--mixed-precision", choices=["bf16", "none"], default="bf16")
    parser.add_argument("--checkpoint-dir", default=None, help="default: a temporary directory")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    """Train, checkpoint both ways, resume both ways (the process group is up)."""
    rank = dist.get_rank()
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    mixed = args.mixed_precision == "bf16"
    ckpt = args.checkpoint_dir or tempfile.mkdtemp(prefix="fsdp1-migration-")
    if args.checkpoint_dir is None:  # every rank writes to the same place
        shared = [ckpt]
        dist.broadcast_object_list(shared, src=0)
        ckpt = shared[0]

    model = wrap(build_model(), mixed, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train(model, optimizer, range(args.steps), "train", device)

    # Full state dict (for inference / single-GPU loading) and the full optimizer state.
    save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
        state_dict = model.state_dict()
    full_osd = FSDP.full_optim_state_dict(model, optimizer)  # only non-empty on rank 0
    if rank == 0:
        torch.save(state_dict, os.path.join(ckpt, "model.pt"))
        torch.save(full_osd, os.path.join(ckpt, "optim.pt"))

    # Sharded state dict (for resuming training): each rank saves its own shard.
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=os.path.join(ckpt, "sharded"))
    dist.barrier()

    resumed = range(args.steps, args.steps + args.resume_steps)
    train(model, optimizer, resumed, "continue", device)

    # Roll back to the sharded checkpoint and repeat the same steps.
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=os.path.join(ckpt, "sharded"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state["optimizer"]))
    train(model, optimizer, resumed, "resume-sharded", device)

    # A fresh model and optimizer from the full checkpoint.
    fresh = wrap(build_model(), mixed, device)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                              FullOptimStateDictConfig()):
        fresh.load_state_dict(torch.load(os.path.join(ckpt, "model.pt"), map_location="cpu", weights_only=True))
    full_osd = torch.load(os.path.join(ckpt, "optim.pt"), weights_only=True) if rank == 0 else None
    fresh_optimizer.load_state_dict(FSDP.scatter_full_optim_state_dict(full_osd, fresh))
    train(fresh, fresh_optimizer, resumed, "resume-full", device)


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    try:
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
