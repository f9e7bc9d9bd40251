"""The ``--ranks``-rank training job of ``benchmarks/goodput.py`` (its docstring says what is measured and why):
the model under each runtime, the training step, each arm's paired blocks and (unless ``--blocks-only``) its
whole runs beside its baseline's, over the rounds; rank 0 keeps the figures in ``--dir``/result.json for the
driver's report (:mod:`goodput_report`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

import peers_systems as ps  # beside this file (goodput.py puts benchmarks/ on sys.path)
import torch
import torch.distributed as dist
from checkpoint_measure import rotated
from goodput_saver import ARMS, SYSTEM, Saver, baseline_of, runtime_of

PRE_TRAIN_PASSES = 3  # untimed passes over the batches per runtime before any arm: its lazy set-up done


def model_args(nbytes: float) -> Any:
    """A Transformer whose weights + AdamW moments (12 bytes a parameter) come near ``nbytes``."""
    from tests.support.models import ModelArgs

    dim = 64 if nbytes < 20e6 else 256 if nbytes < 200e6 else 512
    vocab, ffn = 16 * dim, 3 * dim
    layers = max(1, round((nbytes / 12 - 2 * vocab * dim) / (4 * dim * dim + 3 * dim * ffn)))
    return ModelArgs(vocab_size=vocab, dim=dim, n_heads=4, n_layers=layers, ffn_dim=ffn, max_seq_len=64)


def build(margs: Any, runtime: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from tests.support.models import Transformer

    if runtime == "shardkit":
        from shardkit import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Transformer(margs)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks (the job waits for its slowest rank)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def train_step(model: Any, opt: Any, tokens: torch.Tensor, lock: Any) -> None:
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    with lock:
        opt.step()
    opt.zero_grad(set_to_none=True)


def batches_for(model: Any, batch: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    vocab = model.tok_embeddings.weight.shape[0]
    return [torch.randint(0, vocab, (batch, 65), generator=gen) for _ in range(4)]


def clear(rank: int, root: str, shm: str) -> None:
    """Remove an arm's checkpoints (rank 0: the shared root; every rank: its hot tier), between barriers,
    after an ``os.sync()`` (off the clock): the write-back of a system that does not fsync (torch_checkpointing)
    ends here rather than in the next arm's blocks."""
    os.sync()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    dist.barrier()


# -- the judged measure: paired blocks ---------------------------------------------------------------------------


def baseline_block(model: Any, opt: Any, batches: list[torch.Tensor], label: int, every: int) -> float:
    """``every`` training steps without a save: this rank's seconds."""
    t0 = time.perf_counter()
    for i in range(1, every + 1):
        train_step(model, opt, batches[(label + i) % len(batches)], contextlib.nullcontext())
    return time.perf_counter() - t0


def arm_block(saver: Saver, batches: list[torch.Tensor], label: int, every: int) -> tuple[float, float]:
    """The save of the state at ``label``, the ``every`` training steps it overlaps (the hot arm saving after
    each but the last: that one's save opens the next block), then the wait for the save to commit -- the wait
    the next save of a continuous run starts with.  This rank's (seconds, of them the closing wait)."""
    t0 = time.perf_counter()
    saver.start(label)
    for i in range(1, every + 1):
        train_step(saver.model, saver.opt, batches[(label + i) % len(batches)], saver.lock())
        if i < every and saver.due(label + i):
            saver.start(label + i)
    waited = time.perf_counter()
    saver.wait_commit()
    end = time.perf_counter()
    saver.settle()
    return end - t0, end - waited


def run_blocks(arm: str, model: Any, opt: Any, args: argparse.Namespace, group: Any, round_index: int) -> dict:
    """One arm's ``--steps`` steps as ``--steps / --every`` arm blocks, each paired with a baseline block of
    the same steps on the same model right before or after it (the order alternating block to block and round
    to round); then a last save of the final state, untimed, loaded back and compared bitwise (timed: resume).
    Save labels: the untimed first save holds 0, block k's save ``(k + 1) * every``."""
    rank = dist.get_rank()
    root, shm = os.path.join(args.dir, f"{arm}-blocks"), os.path.join(args.shm, f"{arm}-blocks")
    saver = Saver(arm, model, opt, root, shm, args.every, group)
    saver.warm_up(0)
    batches = batches_for(model, args.batch)
    arm_s, base_s, waits, baseline_first = [], [], [], []
    for k in range(args.steps // args.every):
        label = (k + 1) * args.every
        first = (k + round_index) % 2 == 0
        for which in ("base", "arm") if first else ("arm", "base"):
            dist.barrier()
            if which == "base":
                base_s.append(baseline_block(model, opt, batches, label, args.every))
            else:
                seconds, waited = arm_block(saver, batches, label, args.every)
                arm_s.append(seconds)
                waits.append(waited)
        baseline_first.append(first)
    saves, lag = saver.saves, statistics.median(saver.lags)
    final = (args.steps // args.every + 1) * args.every
    saver.start(final)  # untimed: the state after the last block, for the resume check
    saver.wait_commit()
    resume = saver.timed_resume(final)
    saver.close()
    n = len(arm_s)
    maxed = max_over_ranks(arm_s + base_s + waits + [lag, resume])
    clear(rank, root, shm)
    return {"arm": maxed[:n], "base": maxed[n:2 * n], "wait": maxed[2 * n:3 * n], "lag": maxed[3 * n],
            "resume": maxed[3 * n + 1], "saves": saves, "baseline_first": baseline_first}


# -- the earlier measure: whole runs -----------------------------------------------------------------------------


def run_whole(arm: str, model: Any, opt: Any, args: argparse.Namespace, group: Any) -> dict[str, Any]:
    """``--steps`` steps in one run, saving every ``--every`` (the last step a save), the wait for the last on
    the clock; every step's time kept; then the resume check.  ``none/<runtime>``: the same without saves."""
    rank = dist.get_rank()
    root, shm = os.path.join(args.dir, arm.replace("/", "-")), os.path.join(args.shm, arm.replace("/", "-"))
    saver = Saver(arm, model, opt, root, shm, args.every, group)
    saver.warm_up(0)
    batches = batches_for(model, args.batch)
    dist.barrier()
    started = time.perf_counter()
    steps = []  # each step's time, the save it starts included
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        train_step(model, opt, batches[step % len(batches)], saver.lock())
        if saver.due(step):
            saver.start(step)
        steps.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    saver.wait_commit()
    tail = time.perf_counter() - t0
    wall = time.perf_counter() - started
    saver.settle()
    out: dict[str, Any] = {"wall": wall, "saves": saver.saves, "tail": tail, "steps": max_over_ranks(steps)}
    if arm in SYSTEM:
        out["lag"] = statistics.median(saver.lags)
        out["resume"] = saver.timed_resume(args.steps)
    saver.close()
    keys = ("wall", "resume", "lag", "tail")
    maxed = max_over_ranks([out.get(k, 0.0) for k in keys])
    out.update({k: v for k, v in zip(keys, maxed) if k in out})
    clear(rank, root, shm)
    return out


def whole_runs(arm: str, models: dict[str, Any], args: argparse.Namespace, group: Any, round_index: int) -> dict:
    """The arm's whole run and its baseline's, the baseline first in even rounds: the arm's figures with the
    baseline's wall time and step times beside them."""
    baseline = baseline_of(arm)
    runs = {}
    for one in (baseline, arm) if round_index % 2 == 0 else (arm, baseline):
        runs[one] = run_whole(one, *models[runtime_of(arm)], args, group)
    return {**runs[arm], "baseline": runs[baseline]["wall"], "base_steps": runs[baseline]["steps"]}


# -- the job -----------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ps.install_torch_checkpointing_cpu()
    group = dist.new_group(backend="gloo")
    margs = model_args(args.size)
    models = {rt: build(margs, rt) for rt in ("shardkit", "torch")}
    for model, opt in models.values():  # untimed: each runtime's first steps (lazy set-up) before any arm
        for tokens in batches_for(model, args.batch) * PRE_TRAIN_PASSES:
            train_step(model, opt, tokens, contextlib.nullcontext())
    nbytes = sum(ps.local(t).numel() * 4 for t in models["shardkit"][0].parameters()) * 3 * dist.get_world_size()
    rounds = []
    for r in range(args.rounds):
        row: dict[str, Any] = {}
        for arm in rotated(ARMS, r):
            row[arm] = {"blocks": run_blocks(arm, *models[runtime_of(arm)], args, group, r)}
            if not args.blocks_only:
                row[arm]["run"] = whole_runs(arm, models, args, group, r)
        rounds.append(row)
        if dist.get_rank() == 0:
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, "result.json"), "w") as f:
            json.dump({"rounds": rounds, "state_bytes": nbytes, "model": vars(margs) if hasattr(margs, "__dict__")
                       else str(margs)}, f, default=str)
    dist.barrier()
    dist.destroy_process_group()
