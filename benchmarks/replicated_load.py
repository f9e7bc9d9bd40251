"""Loads at HSDP 2x2: the bytes four ranks ask of storage, shardkit vs torch.distributed.checkpoint.

A state of ``--gb`` GB (fp32 weights + two AdamW moments, LLaMA-shaped) is
saved at 2 ranks (``Shard(0)``) by both systems, then loaded on 4 gloo ranks
into ``(Replicate(), Shard(0))`` on a (2, 2) mesh: HSDP, where the two
replicas of every shard need the same bytes.  Around each load every rank
reads ``rchar`` from ``/proc/self/io`` (bytes its read calls returned: on one
machine the page cache would hide a duplicate read from any block-level
counter); the sum over ranks, divided by the checkpoint's bytes, is the
figure.  Systems, interleaved over ``--reps`` rounds, page cache dropped
before each load when the machine allows it:

* shardkit's ``"default"``: ``load(sd, url)``, whichever mode that is in the
  checkout;
* shardkit's other mode (``"all-or-nothing"``, ``verify_first=True``, or
  ``"one pass"``, ``verify_first=False``; the output says which is which);
* DCP (``dcp.load``).

Target (``benchmarks/checkpoint_targets.py``): the default load asks for at
most 1.05x the checkpoint (each byte read by one replica and sent to the
other); DCP asks for it once per replica.
``benchmarks/checkpoint.py`` runs this as its ``replicas`` phase, one round
per repetition, and adds the targets to its own.

    python benchmarks/replicated_load.py --gb 0.5 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_targets as targets  # noqa: E402 - the targets shared by the checkpoint benchmarks

import shardkit.checkpoint as skc  # noqa: E402 - this checkout first
from benchmarks.checkpoint import build_state, local_sums, shapes_for, zero_state  # noqa: E402

MODES = targets.load_modes(skc.load)  # shardkit's loads: "default" and the other mode, by label
SYSTEMS = (*MODES, "dcp")


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def worker_save(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    state = build_state(shapes_for(args.gb), dist.get_rank(), 2, mesh)
    skc.save(state, f"{args.dir}/shardkit")
    dcp.save(state, checkpoint_id=f"{args.dir}/dcp")
    dist.barrier()
    dist.destroy_process_group()


def worker_load(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from shardkit.checkpoint.geometry.boxes import shard_box

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shapes = shapes_for(args.gb)

    placements = [Replicate(), Shard(0)]

    def target(shape: tuple[int, ...]) -> DTensor:
        local = torch.empty(shard_box(shape, (2, 2), (rank // 2, rank % 2), placements)[1])
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    state = {"model": {k: target(s) for k, s in shapes.items()},
             "optim": {"state": {k: {"exp_avg": target(s), "exp_avg_sq": target(s), "step": torch.tensor(0.0)}
                                 for k, s in shapes.items()},
                       "param_groups": [{"lr": 0.0, "betas": [0.0, 0.0], "eps": 0.0, "weight_decay": 0.0,
                                         "params": list(shapes)}]}}
    out = {}
    for system in SYSTEMS[args.rep % 3:] + SYSTEMS[:args.rep % 3]:
        zero_state(state)
        if rank == 0:
            targets.drop_page_cache()
        dist.barrier()
        before, start = rchar(), time.perf_counter()
        if system == "dcp":
            dcp.load(state, checkpoint_id=f"{args.dir}/dcp")
        else:
            skc.load(state, f"{args.dir}/shardkit", **MODES[system])
        seconds = time.perf_counter() - start
        read = rchar() - before
        dist.barrier()
        out[system] = {"read": read, "seconds": seconds, "sum": sum(local_sums(state).values())}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def launch(args: argparse.Namespace, worker: str, ranks: int, *extra: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           os.path.abspath(__file__), f"--worker={worker}", f"--gb={args.gb}", f"--dir={args.dir}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{worker} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=0.5)
    parser.add_argument("--reps", type=int, default=targets.MIN_ROUNDS)
    parser.add_argument("--dir", default="/tmp/shardkit-replicated-bench")
    parser.add_argument("--worker", choices=("save", "load"))
    parser.add_argument("--rep", type=int, default=0, help="the first round's number (it rotates the order)")
    parser.add_argument("--json", help="write the rounds here instead of printing the report")
    args = parser.parse_args()
    if args.worker == "save":
        return worker_save(args)
    if args.worker == "load":
        return worker_load(args)
    shutil.rmtree(args.dir, ignore_errors=True)
    launch(args, "save", 2)
    size = {"shardkit": dir_bytes(f"{args.dir}/shardkit"), "dcp": dir_bytes(f"{args.dir}/dcp")}
    rounds = []
    for rep in range(args.rep, args.rep + args.reps):
        out = launch(args, "load", 4, f"--rep={rep}")
        rounds.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
        print(f"round {rep + 1 - args.rep}/{args.reps} done", file=sys.stderr, flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "rounds": rounds, "dropped": targets.drop_page_cache()}, f)
        return
    targets.print_verdicts([report({"size": size, "rounds": rounds, "dropped": targets.drop_page_cache()})], args.reps)


def report(result: dict) -> targets.Verdict:
    """Print the table of ``main``'s rounds (``{"size", "rounds", "dropped"}``); return the verdict of the
    default load's bytes."""
    size, rounds = result["size"], result["rounds"]
    print(f"\nHSDP 2x2 load of a {size['shardkit'] / 1e9:.2f} GB checkpoint (DCP's: {size['dcp'] / 1e9:.2f} GB) "
          f"saved at 2 ranks; {len(rounds)} rounds, medians; drop_caches before every load: {result['dropped']}")
    print(targets.describe_modes(skc.load))
    print(f"{'system':<18}{'bytes asked, 4 ranks':>22}{'x checkpoint':>14}{'per rank':>30}{'seconds':>10}")
    sums, ratios = {}, {}
    for system in SYSTEMS:
        asked = [sum(r[k][system]["read"] for k in range(4)) for r in rounds]
        per_rank = [statistics.median(r[k][system]["read"] for r in rounds) / 1e6 for k in range(4)]
        seconds = statistics.median(max(r[k][system]["seconds"] for k in range(4)) for r in rounds)
        ratios[system] = statistics.median(asked) / size["dcp" if system == "dcp" else "shardkit"]
        sums[system] = [r[k][system]["sum"] for r in rounds for k in range(4)]
        print(f"{system:<18}{statistics.median(asked) / 1e9:>19.2f} GB{ratios[system]:>13.2f}x"
              f"{' '.join(f'{x:.0f}' for x in per_rank):>27} MB{seconds:>9.2f}s")
    same = all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for s in MODES for a, b in zip(sums[s], sums["dcp"]))
    print(f"every load filled the same values as DCP's: {same}")
    target = next(t for t in targets.TARGETS if t.key == "hsdp/bytes")
    other = next(s for s in MODES if s != targets.DEFAULT)
    return targets.Verdict(target.name, ratios[targets.DEFAULT], target.limit,
                           f"{other} {ratios[other]:.2f}x, DCP {ratios['dcp']:.2f}x; same values as DCP's: {same}",
                           met_also_requires=same)


if __name__ == "__main__":
    main()
