"""Lose a node, resume from its peer's copy: the hot tier of ``CheckpointManager`` under torchrun.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
        torchrun --nproc-per-node 4 --max-restarts 1 examples/hot_resume.py --root /tmp/hot-run --die-at 6

(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default torchrun shares its rendezvous store with the
workers, and a restarted worker's gloo group then reads the previous attempt's addresses there and cannot
connect; this setting of torch's gives each attempt a store of its own.)

Four ranks play two nodes of two (``local_world_size=2``; each "node" is the directory
``ROOT/hot/node<n>``).  Every step is saved to the hot tier: each rank's shards to its node's directory
and a replica of them to the other node's; every fifth step also goes to the durable root
``ROOT/durable``.

With ``--die-at K``, on the first attempt only, the first rank of the last node waits until step ``K``
is acknowledged, wipes its node's directory (a machine that is gone, disks and all) and kills itself.
torchrun (``--max-restarts 1``) restarts every worker; ``load_latest`` finds step ``K`` assembled from
node 0's own copies and the replicas node 0 kept for node 1, checks every byte, and training goes on
from there: the losses after the restart are, bit for bit, those of a run that never died.

The model and the data are those of ``examples/train.py`` (a small transformer sharded with
``fully_shard``, counting sequences read through an ``ElasticSampler``, whose position is saved with
every step so the resumed run sees exactly the next batches).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from train import build_data, build_model, build_optimizer

import shardkit.checkpoint as skc
from shardkit.data import ElasticLoader

LOCAL_WORLD_SIZE = 2  # ranks per simulated node: 4 ranks on one machine play 2 nodes

# the shape of the model and of the data, as examples/train.py names them (small: seconds per run on CPU)
MODEL_AND_DATA = dict(seed=0, vocab_size=251, dim=32, layers=2, heads=4, seq_len=16, num_samples=48,
                      batch_size=2, global_batch=8, lr=3e-3, mixed_precision="none")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="directory of the run: ROOT/hot/node<n> and ROOT/durable")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps to run")
    parser.add_argument("--die-at", type=int, default=0,
                        help="on the first attempt, lose the last node once step K is saved (0: never)")
    parser.add_argument("--durable-every", type=int, default=5, help="steps divisible by N also go durable")
    parser.add_argument("--local-keep", type=int, default=2, help="complete hot steps each node keeps")
    parser.add_argument("--out", default=None, help="rank 0 writes how it resumed and the losses here as JSON")
    parser.set_defaults(**MODEL_AND_DATA)
    return parser.parse_args(argv)


def make_manager(args: argparse.Namespace) -> skc.CheckpointManager:
    """The durable root every ``--durable-every`` steps, the node-local tier every step."""
    return skc.CheckpointManager(
        os.path.join(args.root, "durable"), keep_last=2, async_save=True,
        local=os.path.join(args.root, "hot", "node{node}"),  # "{node}": rank // local_world_size
        local_world_size=LOCAL_WORLD_SIZE, replicas=1, local_keep=args.local_keep,
        durable_every=args.durable_every)


def endless(loader: ElasticLoader) -> Iterator:
    """Batches epoch after epoch; the sampler moves to the next epoch by itself."""
    while True:
        yield from loader


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sequences: torch.Tensor) -> float:
    """One step on this rank's share of the global batch; the loss averaged over all ranks."""
    tokens, targets = sequences[:, :-1], sequences[:, 1:]
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def lose_the_last_node(manager: skc.CheckpointManager, root: str, step: int) -> None:
    """Play a machine that is lost after its step was acknowledged: the first rank of the last node waits
    for its save (every rank's copy and replica written), wipes the node's directory and dies at once.
    The other ranks block in the next step's collectives until torchrun stops them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != world - LOCAL_WORLD_SIZE:
        return
    manager.wait()
    shutil.rmtree(os.path.join(root, "hot", f"node{rank // LOCAL_WORLD_SIZE}"))
    print(f"rank {rank}: node {rank // LOCAL_WORLD_SIZE} lost after step {step} (its directory wiped)", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun counts its restarts
    dist.init_process_group("gloo")
    model = build_model(args)
    optimizer = build_optimizer(model, args)
    sampler, loader = build_data(args)
    manager = make_manager(args)

    resumed = manager.load_latest(model, optimizer, data=sampler)
    start = resumed[0] if resumed else 0
    last = manager.last_load
    if dist.get_rank() == 0:
        if last is None:
            print(f"attempt {attempt}: nothing to resume under {args.root}; starting at step 1", flush=True)
        else:
            print(f"attempt {attempt}: resumed after step {last.step} from the {last.source} tier in "
                  f"{last.seconds:.2f} s", flush=True)

    losses: dict[int, float] = {}
    batches = endless(loader)
    for step in range(start + 1, args.steps + 1):  # step-N holds the state after N steps
        _, sequences = next(batches)
        losses[step] = train_step(model, optimizer, sequences)
        if dist.get_rank() == 0:
            print(f"step {step:>3}/{args.steps}  loss {losses[step]:.4f}", flush=True)
        manager.save(step, model, optimizer, extra={"loss": losses[step]}, data=sampler)
        if step == args.die_at and attempt == 0:
            lose_the_last_node(manager, args.root, step)
    manager.wait()  # the last background save has completed (raises what it raised)

    if args.out and dist.get_rank() == 0:
        resumed_as = None if last is None else {"step": last.step, "source": last.source, "seconds": last.seconds}
        with open(args.out, "w") as f:
            json.dump({"attempt": attempt, "resumed": resumed_as, "steps": list(losses),
                       "losses": list(losses.values())}, f)
    dist.barrier()  # every rank is done with its collectives before any tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
