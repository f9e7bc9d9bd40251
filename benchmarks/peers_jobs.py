"""The two ``torchrun`` jobs of ``benchmarks/peers.py`` (its docstring says what is measured and why): the
sharded job -- durable save, cold load at its ranks and async save of every system and the raw floors, round
after round in a rotating order -- and the 1-process job, the cold resharding load of the sharded job's last
checkpoints.  They leave their figures in ``--dir`` (``ws2.json``, ``ws1.json``) for the driver's report
(:mod:`peers_report`)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

import checkpoint_targets as targets  # beside this file (peers.py puts benchmarks/ on sys.path)
import peers_systems as ps
import torch.distributed as dist
from checkpoint_measure import rotated
from peers_measure import check_full, evict, join, rank_sums, raw_read_into, raw_write, timed, zero

OPS = (("save", "save, durable"), ("load2", "load, 2 ranks, cold"), ("load1", "load at 1 process (reshard), cold"),
       ("async", "async save, blocking"))
RAW_FROM = 300e6  # the raw targets count from this size on


def worker_two(args: argparse.Namespace) -> None:
    join(args)
    rank = dist.get_rank()
    peers = ps.Peers(args.tc_durable, async_group=dist.new_group(backend="gloo"), device=args.device,
                     tc_direct_io=args.tc_direct_io)
    models = {rt: ps.build(args.size, rt, device=args.device) for rt in ("shardkit", "torch")}
    states = {s: ps.state_of(s, *models[ps.runtime_of(s)]) for s in ps.SYSTEMS}
    states["raw"] = states["raw_into"] = states["shardkit"]
    # the floor of a load from RAW_FROM on: the raw file read straight into the tensors (peers.py's docstring)
    into_tensors = args.device == "cpu" and ps.nbytes_of(states["shardkit"]) * dist.get_world_size() >= RAW_FROM
    expected = {s: rank_sums(states[s]) for s in ps.SYSTEMS}
    out: dict[str, Any] = {"rank_bytes": ps.nbytes_of(states["shardkit"]), "shape": ps.shape_for(args.size),
                           "rounds": [], "evicted_by": ""}

    def where(system: str, what: str) -> str:
        return os.path.join(args.dir, f"{system}-{what}") + (f"/rank{rank}.bin" if system == "raw" else "")

    def fresh(path: str) -> None:
        if rank == 0:
            shutil.rmtree(os.path.dirname(path) if path.endswith(".bin") else path, ignore_errors=True)
        dist.barrier()
        if path.endswith(".bin"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        dist.barrier()

    for r in range(args.warmup + args.rounds):
        row: dict[str, float] = {}
        for s in rotated((*ps.SYSTEMS, "raw"), r):
            fresh(where(s, "main"))
            path = where(s, "main")
            row[f"save/{s}"] = timed(lambda: raw_write(states[s], path) if s == "raw"
                                     else peers.save(s, states[s], path))[0]
        floors = ("raw", "raw_into") if into_tensors else ("raw",)
        for s in rotated((*ps.SYSTEMS, *floors), r) if "load2" in args.ops else ():
            if s != "raw":
                zero(states[s])
            raw = s in floors
            out["evicted_by"] = evict([os.path.dirname(where("raw", "main")) if raw else where(s, "main")], rank)
            time.sleep(args.cold_sleep)
            path = where("raw" if raw else s, "main")
            row[f"load2/{s}"] = timed(lambda: targets.read_sequentially([path]) if s == "raw"
                                      else raw_read_into(states[s], path) if s == "raw_into"
                                      else peers.load(s, states[s], path))[0]
            if s != "raw" and rank_sums(states[s]) != expected["shardkit" if raw else s]:
                raise SystemExit(f"{s}: the load at {dist.get_world_size()} rank(s) does not give back the saved "
                                 f"values (round {r})")
        for s in rotated(ps.SYSTEMS, r) if "async" in args.ops else ():
            path = where(s, "async")
            fresh(path)
            row[f"async/{s}"], wait = timed(lambda: peers.async_save(s, states[s], path))
            wait()
            dist.barrier()
        out["rounds"].append(row)
        if rank == 0:
            print(f"  {args.size / 1e6:g} MB, {dist.get_world_size()} rank(s): round {r + 1}/"
                  f"{args.warmup + args.rounds}", file=sys.stderr, flush=True)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, expected)
    if rank == 0:
        out["expected"] = gathered
        with open(os.path.join(args.dir, "ws2.json"), "w") as f:
            json.dump(out, f)
    peers.close()
    dist.barrier()
    dist.destroy_process_group()


def worker_one(args: argparse.Namespace) -> None:
    join(args)  # a group of one: torch_checkpointing and DCP run as they would at world 1
    with open(os.path.join(args.dir, "ws2.json")) as f:
        expected = json.load(f)["expected"]
    peers = ps.Peers(args.tc_durable, device=args.device, tc_direct_io=args.tc_direct_io)
    model, opt = ps.build(args.size, None, device=args.device)
    states = {s: ps.state_of(s, model, opt) for s in ps.SYSTEMS}
    rounds = []
    for r in range(args.warmup + args.rounds):
        row = {}
        for s in rotated((*ps.SYSTEMS, "raw"), r):
            path = os.path.join(args.dir, f"{s}-main")
            files = sorted(os.path.join(path, n) for n in os.listdir(path)) if s == "raw" else []
            if s != "raw":
                zero(states[s])
            evict([path], 0)
            time.sleep(args.cold_sleep)
            row[f"load1/{s}"] = timed(lambda: targets.read_sequentially(files) if s == "raw"
                                      else peers.load(s, states[s], path))[0]
            if s != "raw":
                check_full(states[s], [e[s] for e in expected], s)
        rounds.append(row)
    with open(os.path.join(args.dir, "ws1.json"), "w") as f:
        json.dump(rounds, f)
    peers.close()
    dist.destroy_process_group()
