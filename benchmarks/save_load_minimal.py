"""A second, minimal measurement of ``save``/``load`` against ``dcp.save``/``dcp.load`` and the disk: it shares
nothing with ``benchmarks/checkpoint.py`` but the two libraries and the definitions of the targets
(``benchmarks/checkpoint_targets.py``), so the two scripts' verdicts mean the same.

Two gloo ranks each hold fp32 ``Shard(0)`` DTensors (weights + two AdamW
moments, ``--gb`` GB in all, ``--tensors`` matrices of equal size, 64 by
default; ``--tensors 6`` makes every local shard larger than glibc's largest
heap allocation, 32 MiB, as a big embedding's is; ``--llama`` uses a
LLaMA-shaped state instead: vocabulary matrices, norms and a ``step`` scalar
per parameter, as ``benchmarks/checkpoint.py`` does).  Per round, in an
order that rotates every round: each system saves to a fresh directory
(both make their data durable: shardkit fsyncs by default, DCP's
``FileSystemWriter`` has ``sync_files=True``); then, each with the page cache
dropped before it, in an order that rotates too, the uncached loads into
zeroed targets: shardkit's ``"default"`` (``load(sd, url)``, whichever mode
that is in the checkout), shardkit's other mode (``"all-or-nothing"``,
``verify_first=True``, or ``"one pass"``, ``verify_first=False``; the output
says which is which), DCP, and the disk's floor (``"raw"``: each rank reads
its half of shardkit's data files front to back with plain reads, nothing
else); then the page-cached loads (the checkpoint's files read once just
before), shardkit's two modes and DCP, rotating too.  A time is the slowest
rank's, from a barrier to the end of the call; the figure is the median over
rounds, with the ratio to DCP's median (and to the raw read's) and the
median of the per-round ratios (each round times every loader within seconds
of the others, so the per-round ratio follows the disk's drift less).  Every
load is checked against the saved sums.  Last, the verdict table of the
targets; the resharded load and the HSDP bytes are not measured here (the
table says so), ``benchmarks/checkpoint.py`` measures them.
``--cold-sleep S`` waits ``S`` seconds after dropping the cache, as
``benchmarks/checkpoint.py`` does ("cold"), so that this VM has handed freed
memory back to the host and every fresh allocation of the load faults its
pages in again.

    python benchmarks/save_load_minimal.py --gb 1.4 --rounds 5
    python benchmarks/save_load_minimal.py --gb 1.4 --rounds 5 --cold-sleep 4
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

import checkpoint_targets as targets  # beside this file: the targets and definitions both benchmarks share
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def llama_shapes(gb: float) -> dict[str, tuple[int, ...]]:
    """A LLaMA-shaped model (dim 1024, ffn 2816, vocab 32000) whose weights + 2 moments reach ``gb``."""
    shapes: dict[str, tuple[int, ...]] = {"emb": (32000, 1024), "out": (32000, 1024)}
    layer = 0
    while 12 * sum(torch.Size(s).numel() for s in shapes.values()) < gb * 1e9:
        shapes.update({f"l{layer}.{n}": (1024, 1024) for n in ("q", "k", "v", "o")})
        shapes.update({f"l{layer}.w1": (2816, 1024), f"l{layer}.w2": (1024, 2816), f"l{layer}.norm": (1024,)})
        layer += 1
    return shapes


def make_state(gb: float, rank: int, count: int, llama: bool, nested: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    rows = int((gb * 1e9 / 3 / count / 4 / 1024) // 2 * 2)  # ``count`` matrices of (rows, 1024), three copies
    shapes = llama_shapes(gb) if llama else {f"t{i}": (rows, 1024) for i in range(count)}
    gen = torch.Generator().manual_seed(rank)

    def shard(shape: tuple[int, ...]) -> DTensor:
        local = torch.empty((shape[0] // 2,) + shape[1:]).uniform_(-1, 1, generator=gen)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    if nested:  # the layout of benchmarks/checkpoint.py: {"model": ..., "optim": {"state", "param_groups"}}
        optim = {k: {"exp_avg": shard(s), "exp_avg_sq": shard(s), "step": torch.tensor(100.0)}
                 for k, s in shapes.items()}
        groups = [{"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "params": list(shapes)}]
        return {"model": {k: shard(s) for k, s in shapes.items()}, "optim": {"state": optim, "param_groups": groups}}
    state = {f"{k}.{kind}": shard(s) for k, s in shapes.items() for kind in ("weight", "exp_avg", "exp_avg_sq")}
    if llama:  # AdamW's step, one scalar per parameter, as a real optimizer state has
        state.update({f"{k}.step": torch.tensor(100.0) for k in shapes})
    return state


def leaves(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state, by a dotted key; DTensors as their local shards."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in leaves(value).items()})
        elif isinstance(value, torch.Tensor):
            out[key] = value.to_local() if hasattr(value, "to_local") else value
    return out


def write_gap(path: str, gb: float) -> None:
    """Write ``gb`` GB of other data (fsynced) to ``path``, replacing what an earlier round wrote there."""
    block = torch.empty(64 << 20, dtype=torch.uint8).random_().numpy()
    with open(path, "wb") as f:
        for _ in range(max(1, int(gb * 1e9 / block.nbytes))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def timed(fn, sampler_ms: float = 0.0) -> float:
    """Seconds of ``fn`` (the slowest rank); ``sampler_ms`` > 0 runs an RSS-sampling thread beside it,
    as ``benchmarks/checkpoint.py`` does for its peak-RSS figures."""
    stop = threading.Event()
    sampler = None
    if sampler_ms > 0:
        import psutil

        proc = psutil.Process()

        def sample() -> None:
            while not stop.wait(sampler_ms / 1e3):
                proc.memory_info()

        sampler = threading.Thread(target=sample, daemon=True)
    dist.barrier()
    if sampler is not None:
        sampler.start()
    start = time.perf_counter()
    fn()
    stop.set()
    if sampler is not None:
        sampler.join()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def worker(args: argparse.Namespace) -> None:
    import shardkit.checkpoint as skc

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = make_state(args.gb, rank, args.tensors, args.llama, args.nested)
    local = leaves(state)
    sums = {k: float(v.double().sum()) for k, v in local.items()}
    systems = ("shardkit", "dcp")
    paths = {s: os.path.join(args.dir, s) for s in systems}
    modes = targets.load_modes(skc.load)  # "default" and the other mode, by label
    loads = {label: (lambda kw=kw: skc.load(state, paths["shardkit"], **kw)) for label, kw in modes.items()}
    loads["dcp"] = lambda: dcp.load(state, checkpoint_id=paths["dcp"])
    loads["raw"] = lambda: targets.read_sequentially(targets.floor_files(paths["shardkit"], rank, 2))
    uncached, cached = tuple(loads), tuple(modes) + ("dcp",)
    times = {f"save {s}": [] for s in systems} | {f"uncached {x}": [] for x in uncached} | \
        {f"cached {x}": [] for x in cached}
    dropped = True
    for round_index in range(args.rounds):
        for system in systems[round_index % 2:] + systems[:round_index % 2]:
            if rank == 0:
                shutil.rmtree(paths[system], ignore_errors=True)
            dist.barrier()
            save = (lambda: skc.save(state, paths[system])) if system == "shardkit" else \
                (lambda: dcp.save(state, checkpoint_id=paths[system]))
            times[f"save {system}"].append(timed(save, args.sampler_ms))
        if args.gap_gb > 0:  # other data written between the saves and the loads, as in a longer benchmark
            write_gap(os.path.join(args.dir, f"gap-{rank}"), args.gap_gb / 2)
        for cache, loaders in (("uncached", uncached), ("cached", cached)):
            shift = round_index % len(loaders)
            for loader in loaders[shift:] + loaders[:shift]:
                for v in local.values():
                    v.zero_()
                dist.barrier()
                if rank == 0 and cache == "uncached":
                    dropped = targets.drop_page_cache() and dropped
                elif rank == 0:
                    targets.read_every_file(paths["dcp" if loader == "dcp" else "shardkit"])
                if cache == "uncached":
                    time.sleep(args.cold_sleep)
                times[f"{cache} {loader}"].append(timed(loads[loader], args.sampler_ms))
                bad = [k for k, v in local.items() if float(v.double().sum()) != sums[k]]
                if loader != "raw" and bad:
                    raise SystemExit(f"{loader} loaded {len(bad)} tensors wrong, e.g. {bad[:3]}")
    if rank == 0:
        print("RESULT " + json.dumps({"times": times, "dropped": dropped, "modes": targets.describe_modes(skc.load)}),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/shardkit-minimal-bench")
    parser.add_argument("--cold-sleep", type=float, default=0.0, help="seconds to wait before each uncached load")
    parser.add_argument("--tensors", type=int, default=64, help="matrices (each with two AdamW moments)")
    parser.add_argument("--llama", action="store_true",
                        help="LLaMA shapes instead: vocabulary matrices, norms, a step per parameter")
    parser.add_argument("--sampler-ms", type=float, default=0.0,
                        help="run an RSS-sampling thread every this many ms during each timed call")
    parser.add_argument("--nested", action="store_true", help="with --llama: nest the state as "
                        "benchmarks/checkpoint.py does (model / optim state / param_groups)")
    parser.add_argument("--gap-gb", type=float, default=0.0,
                        help="write this much other data (both ranks together) between each save and its load")
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.abspath(__file__), "--worker", f"--gb={args.gb}", f"--rounds={args.rounds}", f"--dir={args.dir}",
           f"--cold-sleep={args.cold_sleep}", f"--tensors={args.tensors}", f"--sampler-ms={args.sampler_ms}",
           f"--gap-gb={args.gap_gb}", *(["--llama"] if args.llama else []), *(["--nested"] if args.nested else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(line[len("RESULT "):])
    shutil.rmtree(args.dir, ignore_errors=True)
    report(args, result)


def report(args: argparse.Namespace, result: dict) -> None:
    """The table of every figure beside DCP's and the raw read's, then the verdict table."""
    times, dropped = result["times"], result["dropped"]
    what = "LLaMA-shaped" if args.llama else f"{args.tensors} x 3 tensors"
    print(f"{args.gb} GB state ({what}), 2 gloo ranks, {args.rounds} rounds (orders rotating); uncached: page cache "
          f"dropped before each load: {dropped} (then {args.cold_sleep:g} s asleep); page-cached: the checkpoint's "
          f"files read once before; RSS sampler {args.sampler_ms:g} ms (0: none); {args.gap_gb:g} GB of other data "
          f"written between the saves and the loads")
    print(result["modes"])
    print("raw: each rank reads its half of shardkit's data files front to back (benchmarks/checkpoint_targets.py)")
    print("medians (s); ratio = our median / theirs; per round = median of the per-round ratios [each round]")
    rows = [("save", "shardkit")] + [tuple(k.split(" ", 1)) for k in times
                                     if k.startswith(("uncached", "cached")) and not k.endswith(" dcp")]
    for op, ours in rows:
        a, b = times[f"{op} {ours}"], times[f"{op} dcp"]
        against = [("DCP", b)] + ([("raw", times["uncached raw"])] if op == "uncached" and ours != "raw" else [])
        figures = "; ".join(f"vs {name} {targets.ratio(a, t):.2f}x (per round {targets.per_round_ratio(a, t):.2f}x "
                            f"[{' '.join(f'{x / y:.2f}' for x, y in zip(a, t))}])" for name, t in against)
        print(f"{op} {ours}: {statistics.median(a):.3f} s, DCP {statistics.median(b):.3f} s; {figures}")
    reason = "the page cache could not be dropped here (drop_caches needs root)"
    uncached = (lambda key, a, b: targets.judged(key, a, b)) if dropped else \
        (lambda key, a, b: targets.not_measured(key, reason))
    targets.print_verdicts([
        uncached("load/dcp", times["uncached default"], times["uncached dcp"]),
        uncached("load/raw", times["uncached default"], times["uncached raw"]),
        targets.judged("save/dcp", times["save shardkit"], times["save dcp"]),
        targets.not_measured("reshard/dcp", "this script runs one 2-rank job; benchmarks/checkpoint.py "
                             "measures it (its load at 1 process)"),
        targets.not_measured("hsdp/bytes", "needs 4 ranks; benchmarks/checkpoint.py (replicas phase) or "
                             "benchmarks/replicated_load.py measures it"),
        targets.judged("cached/dcp", times["cached default"], times["cached dcp"]),
    ], args.rounds)


if __name__ == "__main__":
    main()
