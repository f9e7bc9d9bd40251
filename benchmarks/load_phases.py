"""Where a cold load's time goes, phase by phase: shardkit's ``load`` of the ``peers.py`` state at 2 ranks and
in the 1-process resharding load, beside DCP's load of the same state in the same rounds.

    python benchmarks/load_phases.py --size 50MB --rounds 7            # 2 ranks, then 1 process
    python benchmarks/load_phases.py --size 50MB --rounds 7 --profile  # also cProfile rank 0's shardkit loads

Each round drops the page cache (``drop_caches``; root) and sleeps ``--cold-sleep`` s before every load, the
systems in an order that flips each round.  shardkit's load is cut into the spans of
:mod:`shardkit.checkpoint.training.load` (open, plan, prepare, the shared-reads exchange, reads into the
targets, the agreements, values and statefuls) by wrapping the functions it calls with ``time.perf_counter``;
a span's figure is the median over rounds of rank 0's time in it; the total is the slowest rank's.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
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
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

_spans: dict[str, float] = collections.defaultdict(float)


def _wrap(owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spans[label] += time.perf_counter() - started
    setattr(owner, name, timed)


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
            if rank == 0:
                evict()
            dist.barrier()
            time.sleep(args.cold_sleep)
            dist.barrier()
            _spans.clear()
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
                    spans.append(dict(_spans, total=took))
    if rank == 0:
        keys = sorted({k for s in spans for k in s})
        out = {"job": args.job, "world": world,
               "times": {s: statistics.median(v) for s, v in times.items()},
               "spans_ms": {k: 1e3 * statistics.median(s.get(k, 0.0) for s in spans) for k in keys}}
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
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return worker(args)
    os.makedirs(args.dir, exist_ok=True)
    for job, ranks in (("two", 2), ("one", 1)):
        if args.only and args.only != job:
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
               str(29600 + ranks), os.path.abspath(__file__), "--job", job, "--size", args.size, "--rounds",
               str(args.rounds), "--cold-sleep", str(args.cold_sleep), "--dir", args.dir] + (
                   ["--profile"] if args.profile else [])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            sys.exit(f"{job} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        result = json.loads(lines[-1][7:])
        sk, dc = result["times"]["shardkit"], result["times"]["dcp"]
        print(f"{job} ({result['world']} rank(s), {args.size}): shardkit {sk:.4f} s, DCP {dc:.4f} s, "
              f"ratio {sk / dc:.2f}x")
        for key, ms in sorted(result["spans_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {key:28s} {ms:8.2f} ms")
        if "profile" in result:
            print(result["profile"])


if __name__ == "__main__":
    main()
