"""In-training checkpoints: shardkit vs torch.distributed.checkpoint vs the raw disk, in one run.

The state is a LLaMA-shaped model's fp32 weights plus AdamW's two moments
(about ``--gb`` GB in all), sharded ``Shard(0)`` over 2 gloo ranks exactly as
FSDP lays it out.  Every repetition (a round: ``--rounds``, 5 by default)
runs, interleaved (the order of the systems rotates from round to round):

* at 2 ranks (torchrun): ``save`` cold and warm; ``load`` page-cached and
  uncached; ``async_save`` blocking time (first call and a repeat) next to
  the time to copy the local shards to host memory (fresh ``clone`` and a copy
  into preallocated buffers);
* at 1 process (no process group): ``load`` of the 2-rank checkpoints into
  full tensors (resharding), page-cached and uncached.

Systems: shardkit (data files written with ``O_DIRECT``), shardkit with
``direct_io=False`` (saves only: buffered writes), DCP (``dcp.save``/
``load``/``async_save``, its background thread on its own gloo group), and the
raw disk: for saves, each rank writes its shards to one file with ``write``;
for loads, the disk's floor, each rank reads its share of shardkit's own data
files front to back with plain reads and does nothing with the bytes (the
same files on the same blocks as the load, so no loader of them can be
faster: ``checkpoint_targets.py``).  All fsync their data before a save
counts as done.  shardkit loads run twice: ``"default"`` (``load(sd, url)``,
whichever mode that is in the checkout) and the other mode
(``"all-or-nothing"``: ``verify_first=True``, a checking pass over every
needed checksum block, then the read; or ``"one pass"``:
``verify_first=False``); the output says which is which.

"cold": sleep ``--cold-sleep`` s (4) before the op, so the VM has handed
freed memory back to the host (a fresh process sees this); "warm": the op
repeats at once, reusing the memory its previous run freed.  "page-cached":
the checkpoint's files are read once (untimed) before the load; "uncached":
``drop_caches`` (then the cold sleep) before it.  Every load is checked
against float64 sums of the saved state.  Peak RSS is sampled every 5 ms; it
is reported above the RSS before the op, as a fraction of the state bytes the
process holds.

Then, per repetition, a third job trains while saving (``--phases train``;
:mod:`checkpoint_training` says how): blocking time per save, step time while
a save is being written and total time, for ``async_save`` with its writer
process and with a thread, ``dcp.async_save`` with a thread and with a
process, and no saving.  Then, per repetition, one round of
:mod:`replicated_load` (``--phases replicas``): an HSDP 2x2 load on 4 ranks,
the bytes every rank asks of storage, shardkit vs DCP.  Last, the verdict
table: the targets shared with ``save_load_minimal.py`` (defined once in
``checkpoint_targets.py``: a ratio is our median over the rounds / the
other's; the save is the warm one, into a fresh directory, as a training
job's periodic save; the loads are the default's), each MET, MISSED or NOT
MEASURED (a phase left out), then this script's own (``async_save``,
training while saving).

    python benchmarks/checkpoint.py --gb 2 --rounds 5 --dir /tmp/shardkit-ckpt-bench
    python benchmarks/checkpoint.py --phases train --rounds 3   # the training phase alone
    python benchmarks/checkpoint.py --gb 2 --only-rep 0 --results R   # ... one call per repetition,
    python benchmarks/checkpoint.py --gb 2 --report-only --results R  # then the report of all five
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
import checkpoint_targets as targets  # noqa: E402 - the targets and definitions shared with save_load_minimal
import checkpoint_training as training  # noqa: E402 - the training-while-saving phase, beside this file

import shardkit.checkpoint as skc  # noqa: E402 - this checkout first
from shardkit.checkpoint.geometry.boxes import shard_box  # noqa: E402
from shardkit.checkpoint.state.tree import flatten  # noqa: E402

SYSTEMS = ("shardkit", "dcp", "raw", "shardkit-buffered")  # the last: direct_io=False
MODES = targets.load_modes(skc.load)  # shardkit's loads: "default" and the other mode, by label
LOADS = (*MODES, "dcp", "raw")  # raw: the disk's floor, a plain read of shardkit's data files


# -- the state -------------------------------------------------------------


def shapes_for(gb: float) -> dict[str, tuple[int, ...]]:
    """Model parameter shapes (dim 1024, vocab 32000) whose weights + 2 AdamW moments reach ``gb``.

    Where the two vocabulary matrices alone would pass ``gb`` (0.79 GB: a smoke run), the vocabulary shrinks
    to take half of ``gb``, so the state stays near ``gb`` plus one layer (0.12 GB)."""
    dim, ffn, vocab = 1024, 2816, 32000
    if 12 * 2 * vocab * dim > gb * 1e9:
        vocab = max(1, int(gb * 1e9 / 2 / (12 * 2 * dim)))
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


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def max_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn: Callable[[], Any], state_nbytes: int, *, sleep_s: float = 0.0, uncached: bool = False,
          rank: int = 0) -> dict[str, float]:
    """Run ``fn`` between barriers; seconds (slowest rank) and peak RSS above the start (largest rank).

    ``sleep_s``: seconds asleep first ("cold": the VM hands freed memory back); ``uncached``: rank 0 drops
    the page cache first (``"dropped"`` in the result says whether it could)."""
    dropped = targets.drop_page_cache() if uncached and rank == 0 else True
    time.sleep(sleep_s)
    barrier()
    with PeakRSS() as rss:
        start = time.perf_counter()
        fn()
        barrier()
        seconds = time.perf_counter() - start
    return {"s": max_over_ranks(seconds), "rss": max_over_ranks(rss.delta / state_nbytes),
            "dropped": max_over_ranks(float(not dropped)) == 0.0}


# -- the three systems -----------------------------------------------------


def raw_save(state: dict[str, Any], path: str, rank: int) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"rank{rank}.bin"), "wb") as f:
        for _, t in tensors_of(state):
            local = local_of(t)
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
    locals_ = [local_of(t) for _, t in tensors_of(state)]
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


# -- the driver ------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="total state (weights + AdamW) in GB")
    parser.add_argument("--rounds", "--reps", dest="rounds", type=int, default=targets.MIN_ROUNDS,
                        help="repetitions (rounds), each a fresh job per phase, orders rotating")
    parser.add_argument("--cold-sleep", type=float, default=4.0, help="seconds asleep before a cold op and "
                        "after dropping the page cache for an uncached load")
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
        for rep in range(args.rounds) if args.only_rep is None else [args.only_rep]:
            run_repetition(args, rep, phases, results)
        if args.only_rep is not None:
            return
    found: dict[str, targets.Verdict] = {}  # the shared targets measured, by key
    others: list[targets.Verdict] = []  # this script's further targets (async_save, training)
    if "io" in phases:
        measured, others = report(args, results)
        found.update(measured)
    if "train" in phases:
        runs = []
        for rep in range(args.rounds):
            with open(os.path.join(results, f"shardkit-ckpt-bench-train-{rep}.json")) as f:
                runs.append(json.load(f))
        others += [targets.Verdict(name, ours, limit)
                   for name, ours, limit, _ in training.report(runs, args.save_every)]
    if "replicas" in phases:
        import replicated_load  # here, not at the top: it imports this module's helpers

        rounds = []
        for rep in range(args.rounds):
            with open(os.path.join(results, f"shardkit-ckpt-bench-replicas-{rep}.json")) as f:
                rounds.append(json.load(f))
        found["hsdp/bytes"] = replicated_load.report({"size": rounds[0]["size"], "dropped": rounds[0]["dropped"],
                                                      "rounds": [r for res in rounds for r in res["rounds"]]})
    where = {"hsdp/bytes": "replicas"}
    verdicts = [found.get(t.key) or targets.not_measured(t.key, f"the {where.get(t.key, 'io')} phase did not run "
                                                                f"(--phases {args.phases})") for t in targets.TARGETS]
    targets.print_verdicts(verdicts + others, args.rounds)


def run_repetition(args: argparse.Namespace, rep: int, phases: set[str], results: str) -> None:
    """One repetition of every phase in ``phases``; its results are kept in ``results`` (outside ``--dir``,
    which the next repetition wipes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    base = [os.path.abspath(__file__), "--gb", str(args.gb), "--dir", args.dir, "--rep", str(rep),
            "--cold-sleep", str(args.cold_sleep),
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
    print(f"repetition {rep + 1}/{args.rounds} done", file=sys.stderr)


def worker_training(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = training.worker(args, args.rep)
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, f"result-train-{args.rep}.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def report(args: argparse.Namespace,
           results: str) -> tuple[dict[str, targets.Verdict], list[targets.Verdict]]:
    """Print the save/load/async tables from the results kept in ``results``; return the verdicts of the shared
    targets this phase measures (by key) and of this script's own (async_save)."""
    runs: dict[str, list[dict]] = {}
    state_gb, cold_sleep = None, args.cold_sleep
    for rep in range(args.rounds):
        for ws in ("ws2", "ws1"):
            with open(os.path.join(results, f"shardkit-ckpt-bench-{ws}-{rep}.json")) as f:
                data = json.load(f)
            state_gb = data.pop("state_gb_total", state_gb)
            data.pop("rank_bytes", None)
            cold_sleep = data.pop("cold_sleep_s", cold_sleep)  # the 2-rank jobs record it
            for key, value in data.items():
                runs.setdefault(key, []).append(value)

    def med(key: str, field: str = "s") -> float:
        return statistics.median(r[field] for r in runs[key])

    def times(key: str) -> list[float]:
        return [r["s"] for r in runs[key]]  # in repetition order, so the systems' rounds line up

    def spread(key: str) -> str:
        values = sorted(times(key))
        return f"{values[0]:.2f}-{values[-1]:.2f}"

    dropped = all(r.get("dropped", True) for key in runs if key.endswith("/uncached") for r in runs[key])
    print(f"\nstate: {state_gb:.2f} GB (weights + AdamW), 2 gloo ranks; {args.rounds} repetitions, medians (min-max); "
          f"uncached: page cache dropped before every load: {dropped}, then {cold_sleep:g} s asleep")
    print(targets.describe_modes(skc.load))
    print("raw: saves write each rank's shards to one file; loads read each rank's share of shardkit's own data "
          "files front to back (the disk's floor, benchmarks/checkpoint_targets.py)")
    print(f"{'op':32s} {'shardkit s':>17s} {'GB/s':>5s} {'RSS+':>6s} {'DCP s':>6s} {'raw s':>6s} "
          f"{'vs DCP':>6s} {'vs raw':>6s}")
    saves = [("save, 2 ranks, cold", "save", "cold"), ("save, 2 ranks, warm", "save", "warm")]
    loads = [("load, 2 ranks, page-cached", "load2", "page-cached"), ("load, 2 ranks, uncached", "load2", "uncached"),
             ("load at 1 (reshard), page-cached", "load1", "page-cached"),
             ("load at 1 (reshard), uncached", "load1", "uncached")]
    sections = [("shardkit", "save(): data files with O_DIRECT", saves),
                ("shardkit-buffered", "save(direct_io=False): buffered writes", saves)] + \
        [(label, f"shardkit load, {label}", loads) for label in MODES]
    for name, what, ops in sections:
        print(f"-- {what}")
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

    def uncached(key: str, ours: str, theirs: str) -> targets.Verdict:
        if not dropped:
            return targets.not_measured(key, "the page cache could not be dropped here (drop_caches needs root)")
        return targets.judged(key, times(ours), times(theirs))

    found = {
        "load/dcp": uncached("load/dcp", "load2/default/uncached", "load2/dcp/uncached"),
        "load/raw": uncached("load/raw", "load2/default/uncached", "load2/raw/uncached"),
        "save/dcp": targets.judged("save/dcp", times("save/shardkit/warm"), times("save/dcp/warm")),
        "reshard/dcp": uncached("reshard/dcp", "load1/default/uncached", "load1/dcp/uncached"),
        "cached/dcp": targets.judged("cached/dcp", times("load2/default/page-cached"), times("load2/dcp/page-cached")),
    }
    ratio = med("async/shardkit/repeat") / med(pre)
    return found, [targets.Verdict("async_save blocking (repeat) / copy into preallocated host buffers", ratio, 1.2)]


if __name__ == "__main__":
    main()
