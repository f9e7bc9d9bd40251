"""The jobs ``benchmarks/checkpoint.py`` runs, one repetition each: the 2-rank job (saves cold and warm, loads
page-cached and uncached, ``async_save`` beside a copy to host memory), the 1-process job (the resharding load of
the 2-rank checkpoints) and the training-while-saving job (:mod:`checkpoint_training`); each keeps its figures in
``--dir`` for the driver.  The systems: shardkit (``O_DIRECT`` or buffered writes), DCP and the raw disk."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Any, Callable

import checkpoint_targets as targets  # beside this file (the benchmarks put benchmarks/ on sys.path)
import checkpoint_training as training
import peers_systems as ps
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from checkpoint_measure import barrier, max_over_ranks, rotated, timed
from checkpoint_state import build_state, check_sums, local_sums, shapes_for, state_bytes, tensors_of, zero_state

import shardkit.checkpoint as skc

SYSTEMS = ("shardkit", "dcp", "raw", "shardkit-buffered")  # the last: direct_io=False
MODES = targets.load_modes(skc.load)  # shardkit's loads: "default" and the other mode, by label
LOADS = (*MODES, "dcp", "raw")  # raw: the disk's floor, a plain read of shardkit's data files


# -- the three systems -----------------------------------------------------


def raw_save(state: dict[str, Any], path: str, rank: int) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"rank{rank}.bin"), "wb") as f:
        for _, t in tensors_of(state):
            local = ps.local(t)
            f.write(local.reshape(-1).view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())


def run_save(system: str, state: dict[str, Any], path: str, rank: int) -> None:
    if system.startswith("shardkit"):
        skc.save(state, path, direct_io=system == "shardkit")
    elif system == "dcp":
        dcp.save(state, checkpoint_id=path)
    else:
        raw_save(state, path, rank)


def run_load(system: str, state: dict[str, Any], path: str, rank: int) -> None:
    """Load with ``system`` (a label of ``LOADS``) from its checkpoint at ``path``; ``raw`` only reads
    this rank's share of the files at ``path`` (a shardkit checkpoint), the disk's floor."""
    if system in MODES:
        skc.load(state, path, **MODES[system])
    elif system == "dcp":
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    else:
        world = dist.get_world_size() if dist.is_initialized() else 1
        targets.read_sequentially(targets.floor_files(path, rank, world))


# -- the jobs ------------------------------------------------------------


def worker_two_ranks(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    shapes = shapes_for(args.gb)
    state = build_state(shapes, rank, world, mesh)
    nbytes = state_bytes(state)
    sums = local_sums(state)
    totals = {}
    for key, value in sums.items():  # global sums for the 1-process check (Shard(0): shards add up)
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        totals[key] = float(t.item()) if not key.endswith(".step") else value  # plain tensors are replicated
    order = rotated(SYSTEMS, args.rep)
    out: dict[str, Any] = {"state_gb_total": max_over_ranks(nbytes) * world / 1e9, "rank_bytes": nbytes,
                           "cold_sleep_s": args.cold_sleep}

    def path(system: str, tag: str) -> str:
        return os.path.join(args.dir, f"{system}-{tag}")

    for system in order:  # save: cold, then warm (the previous output freed just before)
        out[f"save/{system}/cold"] = timed(lambda: run_save(system, state, path(system, "main"), rank), nbytes,
                                           sleep_s=args.cold_sleep, rank=rank)
    for system in order:
        if rank == 0:
            shutil.rmtree(path(system, "main"), ignore_errors=True)
        barrier()
        out[f"save/{system}/warm"] = timed(lambda: run_save(system, state, path(system, "main"), rank), nbytes,
                                           rank=rank)
    measure_loads("load2", state, sums, out, rank, args)
    measure_async(state, out, nbytes, rank, order, path, args.cold_sleep)
    if rank == 0:
        with open(os.path.join(args.dir, "sums.json"), "w") as f:
            json.dump(totals, f)
        with open(os.path.join(args.dir, f"result-ws2-{args.rep}.json"), "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def measure_loads(op: str, state: dict[str, Any], sums: dict[str, float], out: dict[str, Any], rank: int,
                  args: argparse.Namespace) -> None:
    """Every loader, page-cached (files read once before, untimed) then uncached (page cache dropped, then
    the cold sleep), into ``out[op/system/...]``; every load but the raw read is checked against ``sums``."""
    for cached in ("page-cached", "uncached"):
        for system in rotated(LOADS, args.rep):
            zero_state(state)
            src = os.path.join(args.dir, "dcp-main" if system == "dcp" else "shardkit-main")
            if cached == "page-cached" and rank == 0:
                targets.read_every_file(src)
            uncached = cached == "uncached"
            out[f"{op}/{system}/{cached}"] = timed(lambda: run_load(system, state, src, rank), state_bytes(state),
                                                   sleep_s=args.cold_sleep if uncached else 0.0,
                                                   uncached=uncached, rank=rank)
            if system != "raw":
                check_sums(state, sums, f"{system} {op}")


def measure_async(state: dict[str, Any], out: dict[str, Any], nbytes: int, rank: int, order: tuple,
                  path: Callable[[str, str], str], cold_sleep: float) -> None:
    """async_save blocking time (first and repeat) beside copying the shards to host memory."""
    group = dist.new_group(backend="gloo")
    locals_ = [ps.local(t) for _, t in tensors_of(state)]
    copies: list[torch.Tensor] = []
    # the baseline first, in the same conditions as the first save of each system (cold memory)
    out["async/copy-to-host/clone"] = timed(lambda: copies.extend(t.clone() for t in locals_), nbytes,
                                            sleep_s=cold_sleep, rank=rank)
    out["async/copy-to-host/preallocated"] = timed(
        lambda: [c.copy_(t) for c, t in zip(copies, locals_)], nbytes, sleep_s=cold_sleep, rank=rank)
    copies.clear()
    for system in [s for s in order if s in ("shardkit", "dcp")]:
        for attempt in ("first", "repeat"):
            target = path(system, f"async-{attempt}")
            holder: dict[str, Any] = {}
            start_save = (lambda: skc.async_save(state, target, process_group=group)) if system == "shardkit" else \
                (lambda: dcp.async_save(state, checkpoint_id=target, process_group=group))
            res = timed(lambda: holder.setdefault("f", start_save()), nbytes, sleep_s=cold_sleep, rank=rank)
            start = time.perf_counter()
            holder["f"].result()
            barrier()
            res["background_s"] = max_over_ranks(time.perf_counter() - start)
            out[f"async/{system}/{attempt}"] = res
            if rank == 0:
                shutil.rmtree(target, ignore_errors=True)
            barrier()


def worker_one_process(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    state = build_state(shapes_for(args.gb), 0, 1, None)
    with open(os.path.join(args.dir, "sums.json")) as f:
        sums = json.load(f)
    out: dict[str, Any] = {}
    measure_loads("load1", state, sums, out, 0, args)
    with open(os.path.join(args.dir, f"result-ws1-{args.rep}.json"), "w") as f:
        json.dump(out, f)


def worker_training(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = training.worker(args, args.rep)
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, f"result-train-{args.rep}.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()

