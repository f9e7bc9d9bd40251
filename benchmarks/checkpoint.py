"""In-training checkpoints: shardkit vs torch.distributed.checkpoint vs the raw disk, in one run.

The state is a LLaMA-shaped model's fp32 weights plus AdamW's two moments
(about ``--gb`` GB in all), sharded ``Shard(0)`` over 2 gloo ranks exactly as
FSDP lays it out.  Every repetition runs, interleaved (the order of the three
systems rotates from repetition to repetition):

* at 2 ranks (torchrun): ``save`` cold and warm; ``load`` page-cached and
  uncached; ``async_save`` blocking time (first call and a repeat) next to
  the time to copy the local shards to host memory (fresh ``clone`` and a copy
  into preallocated buffers);
* at 1 process (no process group): ``load`` of the 2-rank checkpoints into
  full tensors (resharding), page-cached and uncached.

Systems: shardkit (data files written with ``O_DIRECT``), shardkit with
``direct_io=False`` (saves only: buffered writes), DCP (``dcp.save``/
``load``/``async_save``, its background thread on its own gloo group), and the
raw disk (each rank writes its shards to one file with ``write`` and reads them
back with ``readinto``).  All fsync their data before a save counts as done.
shardkit loads run twice: the default (a checking pass over every needed
checksum block, then the read: all or nothing) and ``verify_first=False`` (one
pass; a checksum error may leave targets partly loaded).

"cold": sleep 4 s before the op, so the VM has handed freed memory back to the
host (a fresh process sees this); "warm": the op repeats at once, reusing the
memory its previous run freed.  "page-cached": the checkpoint's files are read
once (untimed) before the load; "uncached": ``drop_caches`` (then the cold
sleep) before it.  Every load is checked against float64 sums of the saved
state.  Peak RSS is sampled every 5 ms; it is reported above the RSS before
the op, as a fraction of the state bytes the process holds.

Then, per repetition, a third job trains while saving (``--phases train``;
:mod:`checkpoint_training` says how): blocking time per save, step time while
a save is being written and total time, for ``async_save`` with its writer
process and with a thread, ``dcp.async_save`` with a thread and with a
process, and no saving.  Then, per repetition, one round of
:mod:`replicated_load` (``--phases replicas``): an HSDP 2x2 load on 4 ranks,
the bytes every rank asks of storage, shardkit vs DCP.  Last, every target
with its verdict (MET/MISSED).

    python benchmarks/checkpoint.py --gb 2 --reps 5 --dir /tmp/shardkit-ckpt-bench
    python benchmarks/checkpoint.py --phases train --reps 3   # the training phase alone
    python benchmarks/checkpoint.py --gb 2 --reps 5 --only-rep 0 --results R   # ... one call per repetition,
    python benchmarks/checkpoint.py --gb 2 --reps 5 --report-only --results R  # then the report of all five
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
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_training as training  # noqa: E402 - the training-while-saving phase, beside this file

import shardkit.checkpoint as skc  # noqa: E402 - this checkout first
from shardkit.checkpoint.geometry.boxes import shard_box  # noqa: E402
from shardkit.checkpoint.state.tree import flatten  # noqa: E402

SYSTEMS = ("shardkit", "dcp", "raw", "shardkit-buffered")  # the last: direct_io=False
LOADS = ("shardkit", "shardkit-onepass", "dcp", "raw")  # shardkit-onepass: load(verify_first=False)
COLD_SLEEP_S = 4.0


# -- the state -------------------------------------------------------------


def shapes_for(gb: float) -> dict[str, tuple[int, ...]]:
    """Model parameter shapes (dim 1024, vocab 32000) whose weights + 2 AdamW moments reach ``gb``."""
    dim, ffn, vocab = 1024, 2816, 32000
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, dim), "output.weight": (vocab, dim)}
    layer = 0
    while 12 * sum(torch.Size(s).numel() for s in shapes.values()) < gb * 1e9:
        for name in ("wq", "wk", "wv", "wo"):
            shapes[f"layers.{layer}.attention.{name}.weight"] = (dim, dim)
        shapes[f"layers.{layer}.feed_forward.w1.weight"] = (ffn, dim)
        shapes[f"layers.{layer}.feed_forward.w2.weight"] = (dim, ffn)
        shapes[f"layers.{layer}.attention_norm.weight"] = (dim,)
        shapes[f"layers.{layer}.ffn_norm.weight"] = (dim,)
        layer += 1
    return shapes


def build_state(shapes: dict[str, tuple[int, ...]], rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """``{"model", "optim"}`` with DTensor shards (``mesh``) or full plain tensors (``mesh is None``)."""
    gen = torch.Generator().manual_seed(1234 + rank)

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        local_shape = shape if mesh is None else shard_box(shape, (world,), (rank,), [Shard(0)])[1]
        local = torch.empty(local_shape).uniform_(-1, 1, generator=gen)
        if mesh is None:
            return local
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    model = {k: tensor(s) for k, s in shapes.items()}
    state = {k: {"exp_avg": tensor(s), "exp_avg_sq": tensor(s), "step": torch.tensor(100.0)} for k, s in shapes.items()}
    groups = [{"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "params": list(shapes)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def tensors_of(state: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    return list(flatten(state).tensors.items())


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_sums(state: dict[str, Any]) -> dict[str, float]:
    return {k: float(local_of(t).double().sum()) for k, t in tensors_of(state)}


def zero_state(state: dict[str, Any]) -> None:
    for _, t in tensors_of(state):
        local_of(t).zero_()


def state_bytes(state: dict[str, Any]) -> int:
    return sum(local_of(t).numel() * local_of(t).element_size() for _, t in tensors_of(state))


# -- measuring -------------------------------------------------------------


class PeakRSS:
    """Peak resident set size above the value at start (``delta``), sampled every 5 ms."""

    def __init__(self) -> None:
        import psutil

        proc = psutil.Process()
        self._rss = lambda: proc.memory_info().rss
        self._stop = threading.Event()
        self.base = self.peak = self._rss()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.delta = self.peak - self.base


def warm_cache(path: str) -> None:
    """Read every file under ``path`` once, so the load that follows finds it in the page cache."""
    buf = bytearray(8 << 20)
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def max_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn: Callable[[], Any], state_nbytes: int, *, cold: bool = False, uncached: bool = False,
          rank: int = 0) -> dict[str, float]:
    """Run ``fn`` between barriers; seconds (slowest rank) and peak RSS above the start (largest rank)."""
    if uncached and rank == 0:
        drop_caches()
    if cold or uncached:
        time.sleep(COLD_SLEEP_S)
    barrier()
    with PeakRSS() as rss:
        start = time.perf_counter()
        fn()
        barrier()
        seconds = time.perf_counter() - start
    return {"s": max_over_ranks(seconds), "rss": max_over_ranks(rss.delta / state_nbytes)}


# -- the three systems -----------------------------------------------------


def raw_save(state: dict[str, Any], path: str, rank: int) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"rank{rank}.bin"), "wb") as f:
        for _, t in tensors_of(state):
            local = local_of(t)
            f.write(local.reshape(-1).view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())


def raw_load(state: dict[str, Any], path: str, rank: int, world_saved: int) -> None:
    """Read the 2-rank raw files into this process's tensors (its shards, or full tensors at world 1)."""
    keys = tensors_of(state)
    sharded = any(hasattr(t, "to_local") for _, t in keys)
    for src in ([rank] if sharded else range(world_saved)):
        with open(os.path.join(path, f"rank{src}.bin"), "rb", buffering=0) as f:
            for _, t in keys:
                local = local_of(t)
                if local.dim() == 0 and src > 0 and not sharded:  # replicated scalars: rank 0's copy
                    f.seek(local.element_size(), os.SEEK_CUR)
                    continue
                view = local
                if not sharded and local.dim():  # at world 1: the rows rank ``src`` wrote
                    (row, *_), (rows, *_) = shard_box(tuple(t.shape), (world_saved,), (src,), [Shard(0)])
                    view = local.narrow(0, row, rows)
                mv, got = memoryview(view.reshape(-1).view(torch.uint8).numpy()), 0
                while got < len(mv):
                    got += f.readinto(mv[got:])


def run_save(system: str, state: dict[str, Any], path: str, rank: int) -> None:
    if system.startswith("shardkit"):
    
        skc.save(state, path, direct_io=system == "shardkit")
    elif system == "dcp":
    
        dcp.save(state, checkpoint_id=path)
    else:
        raw_save(state, path, rank)


def run_load(system: str, state: dict[str, Any], path: str, rank: int) -> None:
    if system.startswith("shardkit"):
    
        skc.load(state, path, verify_first=system != "shardkit-onepass")
    elif system == "dcp":
        
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    else:
        raw_load(state, path, rank, 2)


def rotated(systems: tuple[str, ...], rep: int) -> tuple[str, ...]:
    """The systems in the order of repetition ``rep`` (the first one moves on each time)."""
    return systems[rep % len(systems):] + systems[:rep % len(systems)]


def check_sums(state: dict[str, Any], expected: dict[str, float], what: str) -> None:
    got = local_sums(state)
    bad = [k for k, v in expected.items() if abs(got[k] - v) > 1e-6 * max(1.0, abs(v))]
    if bad:
        raise SystemExit(f"{what}: {len(bad)} tensors differ after load, e.g. {bad[:3]}")


# -- the two workers -------------------------------------------------------


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
    out: dict[str, Any] = {"state_gb_total": max_over_ranks(nbytes) * world / 1e9, "rank_bytes": nbytes}
    def path(system: str, tag: str) -> str:
        return os.path.join(args.dir, f"{system}-{tag}")

    for system in order:  # save: cold, then warm (the previous output freed just before)
        out[f"save/{system}/cold"] = timed(lambda: run_save(system, state, path(system, "main"), rank), nbytes,
                                           cold=True, rank=rank)
    for system in order:
        if rank == 0:
            shutil.rmtree(path(system, "main"), ignore_errors=True)
        barrier()
        out[f"save/{system}/warm"] = timed(lambda: run_save(system, state, path(system, "main"), rank), nbytes,
                                           rank=rank)
    measure_loads("load2", state, sums, out, rank, args)
    measure_async(state, out, nbytes, rank, order, path)
    if rank == 0:
        with open(os.path.join(args.dir, "sums.json"), "w") as f:
            json.dump(totals, f)
        with open(os.path.join(args.dir, f"result-ws2-{args.rep}.json"), "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def measure_loads(op: str, state: dict[str, Any], sums: dict[str, float], out: dict[str, Any], rank: int,
                  args: argparse.Namespace) -> None:
    """Every loader, page-cached (files read once before, untimed) then uncached, into ``out[op/system/...]``."""
    for cached in ("page-cached", "uncached"):
        for system in rotated(LOADS, args.rep):
            zero_state(state)
            src = os.path.join(args.dir, f"{system.replace('-onepass', '')}-main")
            if cached == "page-cached" and rank == 0:
                warm_cache(src)
            out[f"{op}/{system}/{cached}"] = timed(lambda: run_load(system, state, src, rank), state_bytes(state),
                                                   uncached=cached == "uncached", rank=rank)
            check_sums(state, sums, f"{system} {op}")


def measure_async(state: dict[str, Any], out: dict[str, Any], nbytes: int, rank: int, order: tuple,
                path: Callable[[str, str], str]) -> None:
    """async_save blocking time (first and repeat) beside copying the shards to host memory."""
    group = dist.new_group(backend="gloo")
    locals_ = [local_of(t) for _, t in tensors_of(state)]
    copies: list[torch.Tensor] = []
    # the baseline first, in the same conditions as the first save of each system (cold memory)
    out["async/copy-to-host/clone"] = timed(lambda: copies.extend(t.clone() for t in locals_), nbytes, cold=True,
                                            rank=rank)
    out["async/copy-to-host/preallocated"] = timed(
        lambda: [c.copy_(t) for c, t in zip(copies, locals_)], nbytes, cold=True, rank=rank)
    copies.clear()
    for system in [s for s in order if s in ("shardkit", "dcp")]:
        for attempt in ("first", "repeat"):
            target = path(system, f"async-{attempt}")
            holder: dict[str, Any] = {}
            start_save = (lambda: skc.async_save(state, target, process_group=group)) if system == "shardkit" else \
                (lambda: dcp.async_save(state, checkpoint_id=target, process_group=group))
            res = timed(lambda: holder.setdefault("f", start_save()), nbytes, cold=True, rank=rank)
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


# -- the driver ------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="total state (weights + AdamW) in GB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/shardkit-ckpt-bench")
    parser.add_argument("--results", default=None, help="folder that keeps each repetition's results "
                        "(default: the parent of --dir)")
    parser.add_argument("--only-rep", type=int, default=None, help="run repetition K alone and keep its "
                        "results, no report (repetitions in separate invocations, e.g. under a time limit)")
    parser.add_argument("--report-only", action="store_true", help="run nothing: report repetitions "
                        "0..reps-1 from the results kept by earlier invocations")
    parser.add_argument("--phases", default="io,train,replicas", help="io (save/load/async), train (training "
                        "while saving), replicas (bytes read by an HSDP 2x2 load), comma-separated")
    parser.add_argument("--replica-gb", type=float, default=0.5, help="state size of the replicas phase")
    parser.add_argument("--worker", choices=("ws2", "ws1", "train"))
    parser.add_argument("--rep", type=int, default=0)
    training.add_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        {"ws2": worker_two_ranks, "ws1": worker_one_process, "train": worker_training}[args.worker](args)
        return
    results = args.results or os.path.dirname(args.dir.rstrip("/")) or "."
    os.makedirs(results, exist_ok=True)
    phases = set(args.phases.split(","))
    if not args.report_only:
        for rep in range(args.reps) if args.only_rep is None else [args.only_rep]:
            run_repetition(args, rep, phases, results)
        if args.only_rep is not None:
            return
    targets = report(args, results) if "io" in phases else []
    if "train" in phases:
        runs = []
        for rep in range(args.reps):
            with open(os.path.join(results, f"shardkit-ckpt-bench-train-{rep}.json")) as f:
                runs.append(json.load(f))
        targets += training.report(runs, args.save_every)
    if "replicas" in phases:
        import replicated_load  # here, not at the top: it imports this module's helpers

        rounds = []
        for rep in range(args.reps):
            with open(os.path.join(results, f"shardkit-ckpt-bench-replicas-{rep}.json")) as f:
                rounds.append(json.load(f))
        targets += replicated_load.report({"size": rounds[0]["size"], "dropped": rounds[0]["dropped"],
                                           "rounds": [r for res in rounds for r in res["rounds"]]})
    print("\ntargets")
    for name, ours, limit, met in targets:
        print(f"  {name:72s} {ours:6.2f} (<= {limit:.2f})  {'MET' if met else 'MISSED'}")


def run_repetition(args: argparse.Namespace, rep: int, phases: set[str], results: str) -> None:
    """One repetition of every phase in ``phases``; its results are kept in ``results`` (outside ``--dir``,
    which the next repetition wipes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    base = [os.path.abspath(__file__), "--gb", str(args.gb), "--dir", args.dir, "--rep", str(rep),
            "--train-steps", str(args.train_steps), "--save-every", str(args.save_every),
            "--train-dim", str(args.train_dim), "--train-layers", str(args.train_layers)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    workers = (["ws2", "ws1"] if "io" in phases else []) + (["train"] if "train" in phases else [])
    for ws in workers:
        subprocess.run([*(torchrun if ws != "ws1" else [sys.executable]), *base, "--worker", ws], check=True,
                       env=env)
        shutil.copy(os.path.join(args.dir, f"result-{ws}-{rep}.json"),
                    os.path.join(results, f"shardkit-ckpt-bench-{ws}-{rep}.json"))
    if "replicas" in phases:
        subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "replicated_load.py"),
                        "--gb", str(args.replica_gb), "--reps", "1", "--rep", str(rep),
                        "--dir", os.path.join(args.dir, "replicas"),
                        "--json", os.path.join(results, f"shardkit-ckpt-bench-replicas-{rep}.json")],
                       check=True, env=env)
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr)


def worker_training(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = training.worker(args, args.rep)
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, f"result-train-{args.rep}.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def report(args: argparse.Namespace, results: str) -> list[tuple[str, float, float, bool]]:
    """Print the save/load/async tables from the results kept in ``results``; return the targets as
    ``(name, ours, limit, met)``."""
    runs: dict[str, list[dict]] = {}
    state_gb = None
    for rep in range(args.reps):
        for ws in ("ws2", "ws1"):
            with open(os.path.join(results, f"shardkit-ckpt-bench-{ws}-{rep}.json")) as f:
                data = json.load(f)
            state_gb = data.pop("state_gb_total", state_gb)
            data.pop("rank_bytes", None)
            for key, value in data.items():
                runs.setdefault(key, []).append(value)

    def med(key: str, field: str = "s") -> float:
        return statistics.median(r[field] for r in runs[key])

    def spread(key: str) -> str:
        values = sorted(r["s"] for r in runs[key])
        return f"{values[0]:.2f}-{values[-1]:.2f}"

    print(f"\nstate: {state_gb:.2f} GB (weights + AdamW), 2 gloo ranks; {args.reps} repetitions, medians (min-max)")
    print(f"{'op':32s} {'shardkit s':>17s} {'GB/s':>5s} {'RSS+':>6s} {'DCP s':>6s} {'raw s':>6s} "
          f"{'vs DCP':>6s} {'vs raw':>6s}")
    saves = [("save, 2 ranks, cold", "save", "cold"), ("save, 2 ranks, warm", "save", "warm")]
    loads = [("load, 2 ranks, page-cached", "load2", "page-cached"), ("load, 2 ranks, uncached", "load2", "uncached"),
             ("load at 1 (reshard), page-cached", "load1", "page-cached"),
             ("load at 1 (reshard), uncached", "load1", "uncached")]
    sections = [("shardkit", "default: checking pass, then read (all or nothing)", saves + loads),
                ("shardkit-onepass", "load(verify_first=False): one pass", loads),
                ("shardkit-buffered", "save(direct_io=False): buffered writes", saves)]
    for name, what, ops in sections:
        print(f"-- {name} ({what})")
        for label, op, variant in ops:
            ours, theirs, raw = f"{op}/{name}/{variant}", f"{op}/dcp/{variant}", f"{op}/raw/{variant}"
            print(f"{label:32s} {med(ours):5.2f} ({spread(ours):>10s}) {state_gb / med(ours):5.2f} "
                  f"{100 * med(ours, 'rss'):5.1f}% {med(theirs):6.2f} {med(raw):6.2f} "
                  f"{med(ours) / med(theirs):5.2f}x {med(ours) / med(raw):5.2f}x")
    print("\nasync_save blocking time (s), 2 ranks; background = from return until committed")
    for system in ("shardkit", "dcp"):
        for attempt in ("first", "repeat"):
            key = f"async/{system}/{attempt}"
            print(f"  {system:9s} {attempt:7s} blocking {med(key):6.3f}  RSS+ {100 * med(key, 'rss'):5.1f}%  "
                  f"background {statistics.median(r['background_s'] for r in runs[key]):6.2f}")
    clone, pre = "async/copy-to-host/clone", "async/copy-to-host/preallocated"
    print(f"  copy of the local shards to host memory: fresh clone {med(clone):.3f} s, "
          f"into preallocated buffers {med(pre):.3f} s")
    print(f"  shardkit repeat / fresh clone = {med('async/shardkit/repeat') / med(clone):.2f}x, "
          f"/ preallocated copy = {med('async/shardkit/repeat') / med(pre):.2f}x")
    limits = [("save, 2 ranks, cold: shardkit / DCP", "save", "cold", 0.6),
              ("load, 2 ranks, uncached: shardkit / DCP", "load2", "uncached", 0.8),
              ("load at 1 (reshard 2 -> 1), uncached: shardkit / DCP", "load1", "uncached", 0.7)]
    targets = [(name, med(f"{op}/shardkit/{v}") / med(f"{op}/dcp/{v}"), limit,
                med(f"{op}/shardkit/{v}") / med(f"{op}/dcp/{v}") <= limit) for name, op, v, limit in limits]
    ratio = med("async/shardkit/repeat") / med(pre)
    targets.append(("async_save blocking (repeat) / copy into preallocated host buffers", ratio, 1.2, ratio <= 1.2))
    return targets


if __name__ == "__main__":
    main()
