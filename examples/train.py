"""Train a small transformer with shardkit's fully_shard, on CPUs or GPUs.

    torchrun --nproc_per_node 2 examples/train.py
    torchrun --nproc_per_node 2 examples/train.py --steps 20 --mixed-precision bf16
    torchrun --nproc_per_node 2 examples/train.py --checkpoint-dir ckpt --save-every 5
    torchrun --nproc_per_node 2 examples/train.py --checkpoint-dir ckpt --save-every 5 --async-save
    torchrun --nproc_per_node 3 examples/train.py --checkpoint-dir ckpt --resume   # on 3 ranks

Every rank holds 1/N of each parameter (a DTensor shard), its gradient and
its AdamW state.  Before a block computes, its parameters are all-gathered;
after, they are freed again; gradients are reduce-scattered back into shards.
Each rank trains on its own slice of every global batch, so the printed loss
is the mean over the global batch, as one process would see it.

With ``--checkpoint-dir`` the run saves model and optimizer state through
``shardkit.checkpoint.CheckpointManager`` (any fsspec URL) and can resume on a
different number of ranks: pass ``--global-batch`` so that the data of a step
does not depend on the world size, and the resumed losses are the ones the
original run would have printed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardkit.checkpoint as skc
from shardkit import MixedPrecisionPolicy, fully_shard
from shardkit.data import ElasticLoader, ElasticSampler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps to run")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights and the data")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step over all ranks (fixed across world sizes; "
                             "must divide by the world size); default: ranks x --batch-size")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--num-samples", type=int, default=96, help="sequences in the synthetic data set")
    parser.add_argument("--vocab-size", type=int, default=251, help="(prime: exercises uneven shards)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mixed-precision", choices=["none", "bf16"], default="none",
                        help="bf16: compute in bfloat16, reduce gradients in float32")
    parser.add_argument("--checkpoint-dir", default=None, help="URL or path of the run's checkpoints")
    parser.add_argument("--save-every", type=int, default=0,
                        help="save after every N steps and after the last one (0: never save)")
    parser.add_argument("--keep-last", type=int, default=2, help="committed steps to keep")
    parser.add_argument("--async-save", action="store_true",
                        help="save in the background: a step waits only for the copy of the state to host memory")
    parser.add_argument("--writer", choices=["process", "thread"], default=None,
                        help="with --async-save: write from a writer process (the default) or a thread")
    parser.add_argument("--resume", action="store_true", help="continue from the newest committed step")
    parser.add_argument("--resume-step", type=int, default=None, help="continue from this committed step")
    parser.add_argument("--losses-out", default=None, help="rank 0 writes the losses here as JSON")
    return parser.parse_args(argv)


class TinyLM(nn.Module):
    """Token + position embeddings, pre-norm transformer blocks, an LM head."""

    def __init__(self, vocab_size: int, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(seq, device=tokens.device))
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.output(self.norm(h))


def build_model(args: argparse.Namespace) -> nn.Module:
    """The model, sharded bottom-up: each block is one all-gather/reduce-scatter
    unit, the root holds the embeddings, the final norm and the head."""
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab_size, args.dim, args.layers, args.heads, args.seq_len)
    policy = MixedPrecisionPolicy()
    if args.mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # built after fully_shard: it holds the sharded DTensor parameters, so its state is sharded too
    return torch.optim.AdamW(model.parameters(), lr=args.lr)


class CountingSequences(torch.utils.data.Dataset):
    """Sample ``i``: a counting sequence ``start, start + k, start + 2k, ...`` (mod vocab) drawn from
    ``(seed, i)`` alone -- easy enough that the loss visibly falls within a few steps."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def __len__(self) -> int:
        return self.args.num_samples

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.args.seed * 100_003 + i)
        start = int(torch.randint(0, self.args.vocab_size, (1,), generator=gen))
        stride = int(torch.randint(1, 4, (1,), generator=gen))
        return i, (start + stride * torch.arange(self.args.seq_len + 1)) % self.args.vocab_size


def build_data(args: argparse.Namespace) -> tuple[ElasticSampler, ElasticLoader]:
    """One global batch sequence whatever the world size; this rank gets its contiguous share of each.

    The sampler's position (epoch, global batches received) is saved with every
    checkpoint, so a run resumed on any number of ranks sees the next batches."""
    world = dist.get_world_size()
    rows = args.global_batch or world * args.batch_size
    if rows % world:
        raise SystemExit(f"--global-batch {rows} does not divide over {world} ranks")
    sampler = ElasticSampler(args.num_samples, global_batch_size=rows, seed=args.seed)
    return sampler, ElasticLoader(CountingSequences(args), batch_sampler=sampler)


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace,
                sampler: ElasticSampler, loader: ElasticLoader, start_step: int = 0,
                device: torch.device = torch.device("cpu"),
                manager: skc.CheckpointManager | None = None) -> tuple[list[float], list[list[int]]]:
    """Run steps ``start_step .. args.steps - 1``; return the global mean losses and the sample indices
    of each global batch.  With a ``manager``, save every ``args.save_every`` steps and after the last."""
    losses: list[float] = []
    batches: list[list[int]] = []
    step = start_step
    for index, sequences in _epochs(loader, args.steps - start_step):
        started = time.perf_counter()
        sequences = sequences.to(device)
        tokens, targets = sequences[:, :-1], sequences[:, 1:]
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= dist.get_world_size()
        losses.append(global_loss.item())
        shares: list = [None] * dist.get_world_size()
        dist.all_gather_object(shares, index.tolist())
        batches.append([i for share in shares for i in share])
        if dist.get_rank() == 0:
            print(f"step {step + 1:>3}/{args.steps}  loss {losses[-1]:.4f}  "
                  f"({(time.perf_counter() - started) * 1e3:.0f} ms)", flush=True)
        if manager is not None and ((step + 1) % args.save_every == 0 or step == args.steps - 1):
            manager.save(step + 1, model, optimizer, extra={"loss": losses[-1]}, data=sampler)  # step-N: N done
        step += 1
    return losses, batches


def _epochs(loader: ElasticLoader, steps: int):
    """``steps`` batches from ``loader``, epoch after epoch (the sampler moves to the next epoch itself)."""
    done = 0
    while done < steps:
        for batch in loader:
            yield batch
            done += 1
            if done == steps:
                return


def resume(model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace,
           sampler: ElasticSampler) -> int:
    """Load the requested committed step in place (any world size); return the next step to run.

    A checkpoint ``step-<N>`` holds the state after ``N`` steps, so the run goes on with step ``N + 1``
    (index ``N``)."""
    manager = skc.CheckpointManager(args.checkpoint_dir)
    if args.resume_step is not None:
        manager.load(args.resume_step, model, optimizer, data=sampler)
        step = args.resume_step
    else:
        found = manager.load_latest(model, optimizer, data=sampler)
        if found is None:
            return 0
        step = found[0]
    if dist.get_rank() == 0:
        print(f"resumed after step {step} of {args.checkpoint_dir} on {dist.get_world_size()} ranks",
              flush=True)
    return step


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    model = build_model(args)
    optimizer = build_optimizer(model, args)
    if dist.get_rank() == 0:
        total = sum(p.numel() for p in model.parameters())
        local = sum(p.to_local().numel() for p in model.parameters())
        print(f"{type(model).__name__}: {total:,} parameters, {local:,} on rank 0 "
              f"({dist.get_world_size()} ranks, {device.type}, mixed precision: {args.mixed_precision})", flush=True)
    sampler, loader = build_data(args)
    start = 0
    if args.checkpoint_dir and (args.resume or args.resume_step is not None):
        start = resume(model, optimizer, args, sampler)
    manager = None
    if args.checkpoint_dir and args.save_every > 0:
        manager = skc.CheckpointManager(args.checkpoint_dir, keep_last=args.keep_last, async_save=args.async_save,
                                        writer=args.writer)
    losses, batches = train_steps(model, optimizer, args, sampler, loader, start_step=start, device=device,
                                  manager=manager)
    if manager is not None:
        manager.wait()  # the last background save has committed (raises what it raised)
    if args.losses_out and dist.get_rank() == 0:
        with open(args.losses_out, "w") as f:
            json.dump({"start": start, "world_size": dist.get_world_size(), "losses": losses, "batches": batches}, f)
    # every rank finishes its last collective before any tears down (gloo can
    # abort a peer that is still sending when the group goes away)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
