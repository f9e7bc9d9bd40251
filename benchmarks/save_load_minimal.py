"""A second, minimal measurement of ``save``/``load`` against ``dcp.save``/``dcp.load``: nothing shared with
``benchmarks/checkpoint.py`` but the two libraries.

Two gloo ranks each hold fp32 ``Shard(0)`` DTensors (weights + two AdamW
moments, ``--gb`` GB in all, ``--tensors`` matrices of equal size, 64 by
default; ``--tensors 6`` makes every local shard larger than glibc's largest
heap allocation, 32 MiB, as a big embedding's is; ``--llama`` uses a
LLaMA-shaped state instead: vocabulary matrices, norms and a ``step`` scalar
per parameter, as ``benchmarks/checkpoint.py`` does).  Per round, in an
order that rotates every round: each system saves to a fresh directory
(both make their data durable: shardkit fsyncs by default, DCP's
``FileSystemWriter`` has ``sync_files=True``); then, each with the page cache
dropped before it, in an order that rotates too, the loads into zeroed
targets: shardkit's default (all or nothing: a checking pass, then the read),
shardkit with ``verify_first=False`` (one pass) and DCP.  A time is the
slowest rank's, from a barrier to the end of the call; the figure is the
median over rounds, with the ratio to DCP's median and the median of the
per-round ratios (each round times every loader within seconds of the
others, so the per-round ratio follows the disk's drift less).
``--cold-sleep S`` waits ``S`` seconds after dropping the cache, as
``benchmarks/checkpoint.py`` does ("cold"), so that this VM has handed freed
memory back to the host and every fresh allocation of the load faults its
pages in again.

    python benchmarks/save_load_minimal.py --gb 1.4 --rounds 6
    python benchmarks/save_load_minimal.py --gb 1.4 --rounds 6 --cold-sleep 4
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


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


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


LOADERS = ("shardkit", "shardkit one pass", "dcp")


def worker(args: argparse.Namespace) -> None:
    import shardkit.checkpoint as skc

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = make_state(args.gb, rank, args.tensors, args.llama, args.nested)
    local = leaves(state)
    sums = {k: float(v.double().sum()) for k, v in local.items()}
    systems = ("shardkit", "dcp")
    paths = {s: os.path.join(args.dir, s) for s in systems}
    loads = {
        "shardkit": lambda: skc.load(state, paths["shardkit"]),
        "shardkit one pass": lambda: skc.load(state, paths["shardkit"], verify_first=False),
        "dcp": lambda: dcp.load(state, checkpoint_id=paths["dcp"]),
    }
    times = {f"save {s}": [] for s in systems} | {f"load {s}": [] for s in LOADERS}
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
        shift = round_index % len(LOADERS)
        for loader in LOADERS[shift:] + LOADERS[:shift]:
            for v in local.values():
                v.zero_()
            dist.barrier()
            if rank == 0:
                drop_caches()
            time.sleep(args.cold_sleep)
            times[f"load {loader}"].append(timed(loads[loader], args.sampler_ms))
            bad = [k for k, v in local.items() if float(v.double().sum()) != sums[k]]
            assert not bad, f"{loader} loaded {len(bad)} tensors wrong, e.g. {bad[:3]}"
    if rank == 0:
        print("RESULT " + json.dumps(times), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dir", default="/tmp/shardkit-minimal-bench")
    parser.add_argument("--cold-sleep", type=float, default=0.0, help="seconds to wait before each load")
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
           f"--cold-sleep={args.cold_sleep}", f"--tensors={args.tensors}", f"--sampler-ms={args.sampler_ms}", f"--gap-gb={args.gap_gb}", *(["--llama"] if args.llama else []),
           *(["--nested"] if args.nested else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    times = json.loads(line[len("RESULT "):])
    shutil.rmtree(args.dir, ignore_errors=True)
    what = "LLaMA-shaped" if args.llama else f"{args.tensors} x 3 tensors"
    print(f"{args.gb} GB state ({what}), 2 gloo ranks, {args.rounds} rounds (orders rotating), page cache dropped "
          f"before each load (then {args.cold_sleep:g} s asleep); RSS sampler {args.sampler_ms:g} ms (0: none); "
          f"{args.gap_gb:g} GB of other data written between the saves and the loads; "
          f"medians, ratio to DCP's median, median of the per-round ratios [all rounds]")
    rows = [("save", "shardkit", "dcp")] + [("load", loader, "dcp") for loader in LOADERS if loader != "dcp"]
    for op, ours, theirs in rows:
        a, b = times[f"{op} {ours}"], times[f"{op} {theirs}"]
        per_round = [x / y for x, y in zip(a, b)]
        print(f"{op} {ours}: {statistics.median(a):.2f} s, DCP {statistics.median(b):.2f} s, "
              f"ratio {statistics.median(a) / statistics.median(b):.2f}x, per round {statistics.median(per_round):.2f}x  "
              f"[{' '.join(f'{r:.2f}' for r in per_round)}]")


if __name__ == "__main__":
    main()
