"""Where a cold load's time goes, phase by phase: shardkit's ``load`` of the ``peers.py`` state at 2 ranks and
in the 1-process resharding load, beside DCP's load of the same state in the same rounds.

    python benchmarks/load_phases.py --size 50MB --rounds 7            # 2 ranks, then 1 process
    python benchmarks/load_phases.py --size 50MB --rounds 7 --profile  # also cProfile rank 0's shardkit loads
    python benchmarks/load_phases.py --old /tmp/old --repeat 3         # another checkout's shardkit beside this
    python benchmarks/load_phases.py --warm --rounds 15                # page-cached: the fixed costs alone

``--old DIR``: a directory holding another checkout's ``shardkit`` package (``git archive <commit> shardkit |
tar -x -C DIR``); each job then runs ``--repeat`` times for each checkout, the order flipping every time, and
the report gives each checkout's shardkit / DCP ratio (DCP measured in the same rounds as its anchor).

Each round drops the page cache (``drop_caches``; root) and sleeps ``--cold-sleep`` s before every load, the
systems in an order that flips each round.  shardkit's load is cut into the spans of
:mod:`shardkit.checkpoint.training.load` (open, plan, prepare, the shared-reads exchange, reads into the
targets, the agreements, values and statefuls) by wrapping the functions it calls with ``time.perf_counter``;
a span's figure is, for each rank, the median over rounds of its time in it; the job's total is the slowest
rank's.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("LOAD_PHASES_SHARDKIT") or os.path.dirname(HERE))
sys.path.insert(0, HERE)
from phase_spans import Spans  # noqa: E402 - beside this script

SPANS = Spans()
_wrap = SPANS.wrap


def install_spans() -> None:
    import shardkit.checkpoint.training.load as load
    from shardkit.checkpoint.formats.native.reader import NativeReader

    for name, label in [("Storage", "storage"), ("Dist", "dist"), ("open_checkpoint", "open"),
                        ("stateful_to_state_dict", "statefuls"), ("flatten", "flatten"),
                        ("plan_load", "plan"), ("share_reads", "shared-reads exchange"),
                        ("read_requests", "reads into targets"), ("prepare_exchange", "prepare exchange"),
                        ("exchange", "exchange"), ("_agree", "agreements"),
                        ("load_into_statefuls", "statefuls"), ("from_json_value", "values")]:
        if hasattr(load, name):
            _wrap(load, name, label)
    from shardkit.checkpoint.io.dist import Dist

    _wrap(NativeReader, "prepare", "prepare")
    _wrap(NativeReader, "check_files", "-- prepare/read: sizes and headers of the data files")
    _wrap(NativeReader, "_prefetch", "-- prepare/read: read-ahead hints")
    _wrap(Dist, "arrive", "-- collectives: arrival at the store")
    _wrap(NativeReader, "close", "close")


def evict() -> None:
    import checkpoint_targets as targets

    if not targets.drop_page_cache():
        raise SystemExit("load_phases.py needs root: it drops the page cache before every load")


def worker(args: argparse.Namespace) -> None:
    import peers_systems as ps
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import torch.distributed.checkpoint as dcp

    import shardkit.checkpoint as skc

    install_spans()
    nbytes = float(args.size.upper().replace("GB", "e9").replace("MB", "e6"))
    runtime = (lambda s: ps.runtime_of(s)) if world > 1 else (lambda s: None)
    states = {}
    for system in ("shardkit", "dcp"):
        model, opt = ps.build(nbytes, runtime(system))
        states[system] = (ps.state_of(system, model, opt), model, opt)
    paths = {s: os.path.join(args.dir, s) for s in states}
    if args.job == "two":
        for system, (state, _, _) in states.items():
            if rank == 0:
                shutil.rmtree(paths[system], ignore_errors=True)
            dist.barrier()
            (skc.save if system == "shardkit" else (lambda st, p: dcp.save(st, checkpoint_id=p)))(state, paths[system])
    dist.barrier()
    times: dict[str, list[float]] = collections.defaultdict(list)
    spans: list[dict[str, float]] = []
    profile = cProfile.Profile() if args.profile and rank == 0 else None
    order = ("shardkit", "dcp")
    for r in range(args.rounds + 1):
        for system in (order if r % 2 == 0 else order[::-1]):
            state = states[system][0]
            if rank == 0 and not args.warm:
                evict()
            dist.barrier()
            time.sleep(0 if args.warm else args.cold_sleep)
            dist.barrier()
            SPANS.clear()
            if profile is not None and system == "shardkit" and r:
                profile.enable()
            start = time.perf_counter()
            if system == "shardkit":
                skc.load(state, paths[system])
            else:
                dcp.load(state, checkpoint_id=paths[system])
            took = time.perf_counter() - start
            if profile is not None:
                profile.disable()
            t = torch.tensor([took], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r:  # round 0 warms up
                times[system].append(float(t))
                if system == "shardkit":
                    spans.append(dict(SPANS.seconds(), total=took))
    every: list[Any] = [None] * world
    dist.all_gather_object(every, spans)
    if rank == 0:
        assert skc.__file__.startswith(os.environ.get("LOAD_PHASES_SHARDKIT") or os.path.dirname(HERE)), skc.__file__
        keys = sorted({k for s in spans for k in s})
        out = {"job": args.job, "world": world,
               "times": {s: statistics.median(v) for s, v in times.items()},
               "spans_ms": {k: [1e3 * statistics.median(s.get(k, 0.0) for s in theirs) for theirs in every]
                            for k in keys}}
        if profile is not None:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(45)
            out["profile"] = text.getvalue()
        print("RESULT " + json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="50MB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cold-sleep", type=float, default=0.3)
    parser.add_argument("--dir", default="/tmp/shardkit-load-phases")
    parser.add_argument("--only", choices=("two", "one"))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--warm", action="store_true", help="leave the page cache as it is: the CPU's share alone")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--old", help="a directory holding another checkout's shardkit package")
    parser.add_argument("--repeat", type=int, default=1, help="jobs per checkout (with --old)")
    args = parser.parse_args()
    if args.job:
        return worker(args)
    os.makedirs(args.dir, exist_ok=True)
    checkouts = [("this", "")] + ([("old", os.path.abspath(args.old))] if args.old else [])
    for job, ranks in (("two", 2), ("one", 1)):
        if args.only and args.only != job:
            continue
        ratios: dict[str, list[float]] = collections.defaultdict(list)
        for i in range(args.repeat if args.old else 1):
            for name, root in checkouts if i % 2 == 0 else checkouts[::-1]:
                result = run_job(args, job, ranks, root)
                sk, dc = result["times"]["shardkit"], result["times"]["dcp"]
                ratios[name].append(sk / dc)
                print(f"{job} ({result['world']} rank(s), {args.size}, {name} checkout): shardkit {sk:.4f} s, "
                      f"DCP {dc:.4f} s, ratio {sk / dc:.2f}x")
                for key, ms in sorted(result["spans_ms"].items(), key=lambda kv: -max(kv[1])):
                    print(f"  {key:56s} " + " ".join(f"{m:8.2f}" for m in ms) + " ms")
                if "profile" in result:
                    print(result["profile"])
        if args.old:
            print(f"{job}: shardkit / DCP, median over {args.repeat} jobs: " + ", ".join(
                f"{name} {statistics.median(r):.3f}x" for name, r in ratios.items()))


def run_job(args: argparse.Namespace, job: str, ranks: int, root: str) -> dict[str, Any]:
    """One torchrun job of ``ranks`` ranks loading with the shardkit of ``root`` (this checkout's if empty)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
           str(29600 + ranks), os.path.abspath(__file__), "--job", job, "--size", args.size, "--rounds",
           str(args.rounds), "--cold-sleep", str(args.cold_sleep), "--dir", args.dir] + (
               ["--profile"] if args.profile else []) + (["--warm"] if args.warm else [])
    env = {**os.environ, "LOAD_PHASES_SHARDKIT": root}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"{job} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


if __name__ == "__main__":
    main()
