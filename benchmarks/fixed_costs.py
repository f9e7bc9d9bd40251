"""The fixed cost per call of ``save``, ``load`` and ``async_save`` at small states, and where it goes:
two checkouts of shardkit measured in one run, interleaved (docs/performance.md, "Fixed costs of a small
save and load").

    python benchmarks/fixed_costs.py --old /tmp/old-checkout --rounds 7   # old vs this checkout
    python benchmarks/fixed_costs.py --rounds 7                            # this checkout alone

``--old`` is a directory holding another checkout's ``shardkit`` package (e.g. ``git archive <commit>
shardkit | tar -x -C /tmp/old-checkout``); it is put first on ``PYTHONPATH``.  Per round, in an order that
flips every round, each checkout runs each configuration (5 MB and 50 MB of fp32 matrices; 1 process, and
2 gloo ranks under torchrun holding ``Shard(0)`` DTensors) in a fresh process: one warm-up call of each
operation, then ``--iters`` calls each -- ``save`` (fsync on, as by default), ``load`` of what it saved
(page-cached), ``async_save`` (its blocking part and its completion), and a ``CheckpointManager``'s ``save`` of
a model holding the same bytes (a stack of linear layers, ``fully_shard`` per layer at several ranks; RNG
saved, keep_last=2) and ``load_latest`` of it.  A time is the slowest rank's,
from a barrier; the figure is the median over rounds of each process's median.  Every call is also broken
down by wrapping the functions it goes through (collectives and the arrival before them, JSON, file
writes, fsyncs, thread starts, planning, commit, reads) with ``time.perf_counter`` spans summed per call.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
CONFIGS = [(5, 1), (5, 2), (5, 4), (50, 1), (50, 2), (50, 4)]
OPS = ("save", "load", "async", "manager.save", "manager.load_latest")
sys.path.insert(0, str(HERE.parent))
from phase_spans import Spans  # noqa: E402 - beside this script

SPANS = Spans()
_wrap = SPANS.wrap


def _install_spans() -> None:
    import concurrent.futures.thread as futures_thread

    import shardkit.checkpoint.formats as formats
    import shardkit.checkpoint.formats.native.manifest as manifest
    import shardkit.checkpoint.formats.native.reader as reader
    import shardkit.checkpoint.formats.native.writer as writer
    import shardkit.checkpoint.io.concurrency as concurrency
    import shardkit.checkpoint.io.dist as dist
    import shardkit.checkpoint.io.local_disk as local_disk
    import shardkit.checkpoint.training.load as load
    import shardkit.checkpoint.training.save as save
    import shardkit.checkpoint.training.save_commit as save_commit
    import shardkit.wire.collectives as collectives

    modules = [dist, collectives, writer, manifest, local_disk, save, save_commit, load, reader, concurrency,
               formats]

    def everywhere(name: str, label: str) -> None:  # a function imported by name into several modules
        original = next((m.__dict__[name] for m in modules if name in m.__dict__), None)
        for module in modules:
            if original is not None and module.__dict__.get(name) is original:
                _wrap(module, name, label)

    _wrap(dist.Dist, "arrive", "arrival at a collective (store)")
    _wrap(dist.Dist, "_finish", "collective itself (gloo)")
    everywhere("encode_json", "JSON encode (collectives)")
    everywhere("decode_json", "JSON decode (collectives)")
    everywhere("dump_manifest", "manifest JSON dump")
    everywhere("parse_manifest", "manifest parse + check")
    _wrap(writer.NativeWriter, "write_file", "write a data file (in its thread)")
    _wrap(writer.NativeWriter, "commit", "commit: validate + put manifest")
    _wrap(os, "fsync", "os.fsync (files and directories)")
    everywhere("fsync_directory", "fsync a directory")
    _wrap(save, "plan_save", "plan_save (with its collective)")
    everywhere("commit_gathered", "commit_gathered (rank 0)")
    everywhere("parallel_map", "parallel_map (the caller)")
    _wrap(futures_thread.ThreadPoolExecutor, "__init__", "ThreadPoolExecutor()")
    _wrap(futures_thread.ThreadPoolExecutor, "shutdown", "ThreadPoolExecutor.shutdown")
    _wrap(threading.Thread, "start", "Thread.start")
    everywhere("open_reader", "open_reader (manifest read)")
    _wrap(load, "plan_load", "plan_load")
    _wrap(reader.NativeReader, "read", "reader.read (data + crc32c)")


def rank_run(args: argparse.Namespace) -> None:
    """One process (or torchrun rank): warm-up, then ``args.iters`` calls of each operation; prints JSON."""
    import torch
    import torch.distributed as dist

    import shardkit.checkpoint as skc

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, state = 0, None
    torch.manual_seed(0)
    n_tensors = 12
    rows = int(args.mb * 1e6 / 4 / n_tensors) // 64
    full = {f"layer{i}.weight": torch.randn(rows, 64) for i in range(n_tensors)}
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (world,))
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    else:
        state = dict(full)
    state["step"] = 3
    model = _manager_model(args.mb, world)
    manager = skc.CheckpointManager(f"{args.dir}/{os.environ.get('MASTER_PORT', os.getpid())}-manager", keep_last=2)
    skc.save  # noqa: B018 - resolve the lazy names before the spans wrap their modules' functions
    _install_spans()
    base = f"{args.dir}/{os.environ.get('MASTER_PORT', os.getpid())}"
    times: dict[str, list[float]] = {op: [] for op in (*OPS, "async, blocking")}
    spans: dict[str, dict[str, list[float]]] = {op: {} for op in OPS}
    first: dict[str, float] = {}

    def slowest(seconds: float) -> float:
        if world == 1:
            return seconds
        t = torch.tensor([seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    for it in range(args.iters + 1):
        for op in OPS:
            if world > 1:
                dist.barrier()
            SPANS.clear()
            started = time.perf_counter()
            if op == "save":
                skc.save(state, f"{base}/save{it}")
            elif op == "load":
                skc.load(state, f"{base}/save{it}")
            elif op == "manager.save":
                manager.save(it, model)
            elif op == "manager.load_latest":
                manager.load_latest(model)
            else:
                future = skc.async_save(state, f"{base}/async{it}")
                blocking = slowest(time.perf_counter() - started)
                future.result()
            took = slowest(time.perf_counter() - started)
            if it == 0:
                first[op] = took
                continue
            times[op].append(took)
            if op == "async":
                times["async, blocking"].append(blocking)
            for label, (n, s) in SPANS.taken().items():
                entry = spans[op].setdefault(label, [0, 0.0])
                entry[0] += n / args.iters
                entry[1] += 1e3 * s / args.iters
    if world > 1:
        dist.barrier()
    if rank == 0:
        print(json.dumps({"shardkit": skc.__file__, "first": first, "spans": spans,
                          "median": {op: statistics.median(v) for op, v in times.items()}}))
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(manager.root_url, ignore_errors=True)
    if world > 1:
        dist.destroy_process_group()


def _manager_model(mb: float, world: int) -> Any:
    """A stack of 12 square linear layers (no bias) holding ``mb`` MB, sharded per layer at several ranks."""
    import torch

    import shardkit

    dim = int((mb * 1e6 / 4 / 12) ** 0.5) // 8 * 8
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(12)])
    if world > 1:
        for layer in model:
            shardkit.fully_shard(layer)
        shardkit.fully_shard(model)
    return model


def drive(args: argparse.Namespace) -> list[dict[str, Any]]:
    trees = {"new": str(ROOT)} | ({"old": args.old} if args.old else {})
    records, port = [], 29700 + os.getpid() % 1000
    for r in range(args.rounds):
        order = sorted(trees) if r % 2 == 0 else sorted(trees, reverse=True)
        for mb, world in CONFIGS:
            for tree in order:
                port += 1
                env = {**os.environ, "PYTHONPATH": trees[tree], "OMP_NUM_THREADS": "1"}
                cmd = [str(HERE), "--rank-run", "--mb", str(mb), "--iters", str(args.iters), "--dir", args.dir]
                if world > 1:
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                           "--master-port", str(port), *cmd]
                else:
                    cmd = [sys.executable, *cmd]
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
                lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
                if not lines:
                    sys.exit(f"{tree} {mb} MB at {world} rank(s) failed:\n{run.stderr[-3000:]}")
                records.append({"round": r, "tree": tree, "mb": mb, "world": world, **json.loads(lines[-1])})
    return records


def report(records: list[dict[str, Any]]) -> None:
    trees = sorted({r["tree"] for r in records}, reverse=True)  # old first
    med = statistics.median
    print("| state, ranks | call | " + " | ".join(f"{t} (ms)" for t in trees) + (" | new/old |" if
                                                                                 len(trees) == 2 else " |"))
    print("|---" * (2 + len(trees) + (len(trees) == 2)) + "|")
    for mb, world in CONFIGS:
        for op in (*OPS, "async, blocking"):
            got = [med(1e3 * r["median"][op] for r in records if (r["mb"], r["world"], r["tree"]) == (mb, world, t))
                   for t in trees]
            ratio = f" | {got[1] / got[0]:.2f}x" if len(got) == 2 else ""
            print(f"| {mb} MB, {world} | {op} | " + " | ".join(f"{g:.1f}" for g in got) + ratio + " |")
    print("\nWhere a call's time goes (per call: count, ms; median over rounds; threads' spans overlap)")
    for mb, world in CONFIGS:
        for op in OPS:
            print(f"\n{mb} MB, {world} rank(s), {op}:")
            mine = [r for r in records if (r["mb"], r["world"]) == (mb, world)]
            for label in sorted({k for r in mine for k in r["spans"][op]}):
                cells = []
                for t in trees:
                    xs = [r["spans"][op].get(label, [0, 0.0]) for r in mine if r["tree"] == t]
                    cells.append(f"{t}: {med(x[0] for x in xs):4.1f} x, {med(x[1] for x in xs):6.2f} ms")
                print(f"  {label:38s} " + " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", help="a directory holding another checkout's shardkit package")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/shardkit-fixed-costs")
    parser.add_argument("--json", help="also write every record to this file")
    parser.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=float, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        rank_run(args)
        return
    records = drive(args)
    if args.json:
        Path(args.json).write_text(json.dumps(records))
    report(records)


if __name__ == "__main__":
    main()
