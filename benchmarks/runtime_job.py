"""The ranks' side of ``benchmarks/runtime.py`` (its docstring says what is measured and why): joining the job,
building one implementation's model and optimizer, a training step, and the two jobs -- phase 1's interleaved
steps of every implementation in one job, phase 2's fresh job of one -- each printing its ranks' figures on one
``RESULT`` line for the driver."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from runtime_meters import DevicePeak, HeapPeak, hwm_mib  # beside this file (the script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
IMPLS = ("shardkit", "torch")
DEBUG = "shardkit+debug"  # shardkit with debug mode on, timed in phase 1 only


def _init(args: argparse.Namespace):
    """Join the job's process group (NCCL and this rank's GPU with ``--device cuda``); the memory meter."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        return DevicePeak()
    dist.init_process_group("gloo")
    return HeapPeak()


def _sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        import torch

        torch.cuda.synchronize()


def _build(impl: str, args: argparse.Namespace):
    """The model of one implementation (``DEBUG`` builds shardkit's) and its optimizer:
    per-block fully_shard plus the root, after tensor parallelism when ``--tp`` > 1."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(REPO))
    from tests.support.models import ModelArgs, Transformer, parallelize_blocks

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from shardkit import fully_shard
    margs = ModelArgs(vocab_size=args.vocab, dim=args.dim, n_heads=args.heads, n_layers=args.layers,
                      ffn_dim=args.ffn, max_seq_len=args.seq)
    torch.manual_seed(0)
    model = Transformer(margs).to(args.device)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),)) if args.device == "cuda" else None
    if args.tp > 1:
        world = init_device_mesh(args.device, (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize_blocks(model, world["tp"])
        mesh = world["dp"]
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _data_parallel_rank(args: argparse.Namespace) -> int:
    """Tensor-parallel peers train on the same batch."""
    import torch.distributed as dist

    return dist.get_rank() // args.tp


def _train_step(model, opt, tokens, args: argparse.Namespace, debug: bool = False) -> None:
    import torch
    import torch.nn.functional as F

    import shardkit

    if debug:
        shardkit.set_debug(True)
    try:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
    finally:
        if debug:
            shardkit.set_debug(False)
    clip = shardkit.clip_grad_norm_ if args.tp > 1 else torch.nn.utils.clip_grad_norm_
    clip(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def _emit(result) -> None:
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.barrier()  # no rank tears gloo down while a peer still sends
    dist.destroy_process_group()
    # torch 2.13 + gloo occasionally aborts in interpreter teardown ("terminate called
    # without an active exception"), with either implementation; the results are out
    sys.stdout.flush()
    os._exit(0)


def worker_interleaved(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    heap = _init(args)
    rank = dist.get_rank()
    timed = (*IMPLS, DEBUG)
    models = {impl: _build(impl, args) for impl in timed}
    gen = torch.Generator().manual_seed(1 + _data_parallel_rank(args))
    wall = {impl: [] for impl in timed}
    cpu = {impl: [] for impl in timed}
    peak = {impl: [] for impl in timed}
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
        order = timed[step % len(timed):] + timed[:step % len(timed)]  # each goes first in turn
        for impl in order:
            dist.barrier()
            heap.reset()
            start, cpu_start = time.perf_counter(), time.process_time()
            _train_step(*models[impl], tokens, args, debug=impl == DEBUG)
            _sync(args)
            wall[impl].append((time.perf_counter() - start) * 1e3)
            cpu[impl].append((time.process_time() - cpu_start) * 1e3)
            peak[impl].append(heap.above_start_mib())
    heap.stop()
    result = {"rank": rank, "params": sum(p.numel() for p in models["shardkit"][0].parameters())}
    for impl in timed:
        walls = torch.tensor(wall[impl], device=args.device)
        dist.all_reduce(walls, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        result[impl] = {"wall": walls.tolist()[args.warmup:], "cpu": cpu[impl][args.warmup:],
                        "heap": peak[impl][args.warmup:]}
    _emit(result)


def worker_memory(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    heap = _init(args)
    heap.reset()
    model, opt = _build(args.impl, args)
    gen = torch.Generator().manual_seed(1 + _data_parallel_rank(args))
    first_ms = 0.0
    for step in range(args.warmup + args.memory_steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
        dist.barrier()
        start = time.perf_counter()
        _train_step(model, opt, tokens, args)
        _sync(args)
        if step == 0:  # cold: lazy init, first allocations, first dispatch of every op
            first_ms = (time.perf_counter() - start) * 1e3
    heap.stop()
    in_use = max(heap.peak, heap.read()) / 2**20 if heap.read else float("nan")
    _emit({"rank": dist.get_rank(), "hwm_mib": hwm_mib(), "first_ms": first_ms, "heap_peak_mib": in_use})
