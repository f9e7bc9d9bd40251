"""shardkit's fully_shard against torch's own fully_shard: time per step and
peak memory, 2 gloo ranks on the CPU, measured in one run, interleaved.

    python benchmarks/runtime.py                # launches the ranks itself
    python benchmarks/runtime.py --rounds 5 --steps 20 --json

Each round launches a fresh 2-rank job per implementation (alternating which
goes first), so every figure comes from a clean process: the same model, the
same seed, the same batches, the same AdamW + clip_grad_norm_ step.  Per
implementation we report:

* ``first ms``: the first step (cold: buffers are allocated and first touched),
* ``ms/step``:  the median over the timed steps after warm-up, each step
  timed as the slowest rank (steps start on a barrier),
* ``peak RSS``: the process's high-water mark (``VmHWM``) per rank, and the
  growth of RSS over the training steps (peak minus RSS before the first step),
* ``peak heap``: the peak of bytes held by malloc (glibc ``mallinfo2``: heap in
  use plus mmapped blocks) over the timed steps, minus the figure at their
  start.  Sampled every 0.5 ms; unlike RSS it does not depend on when freed
  pages are handed back to the host, so it is the stable memory figure here,

and the ratios shardkit / torch (target: <= 1.0 for both).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_reader():
    """Bytes malloc holds for the program (glibc >= 2.33), or None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def read() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    return read


class _PeakSampler:
    """Samples RSS and malloc's bytes in use to find their peaks during the steps."""

    def __init__(self) -> None:
        self.peak = 0
        self.heap = _heap_reader()
        self.heap_start = self.heap() if self.heap else 0
        self.heap_peak = self.heap_start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        ticks = 0
        while not self._stop.is_set():
            if self.heap:
                self.heap_peak = max(self.heap_peak, self.heap())
            if ticks % 4 == 0:
                self.peak = max(self.peak, _rss_kib("VmRSS"))
            ticks += 1
            time.sleep(0.0005)

    def __enter__(self) -> "_PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO))
    from tests.models import ModelArgs, Transformer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    margs = ModelArgs(vocab_size=args.vocab, dim=args.dim, n_heads=args.heads, n_layers=args.layers,
                      ffn_dim=args.ffn, max_seq_len=args.seq)
    torch.manual_seed(0)
    model = Transformer(margs)
    if args.impl == "shardkit":
        from shardkit import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + rank)

    def step() -> float:
        tokens = torch.randint(0, margs.vocab_size, (args.batch, args.seq + 1), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return (time.perf_counter() - start) * 1e3

    rss_before = _rss_kib("VmRSS")
    with _PeakSampler() as sampler:
        times = [step() for _ in range(args.warmup + args.steps)]
    timed = torch.tensor(times)
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    result = {
        "impl": args.impl, "rank": rank,
        "first_ms": timed[0].item(),
        "median_ms": statistics.median(timed[args.warmup:].tolist()),
        "hwm_mib": _rss_kib("VmHWM") / 1024,
        "step_growth_mib": (max(sampler.peak, _rss_kib("VmRSS")) - rss_before) / 1024,
        "heap_peak_mib": (sampler.heap_peak - sampler.heap_start) / 2**20 if sampler.heap else float("nan"),
        "params": sum(p.numel() for p in model.parameters()),
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.barrier()  # no rank tears gloo down while a peer still sends
    dist.destroy_process_group()
    # torch 2.13 + gloo occasionally aborts in interpreter teardown ("terminate called
    # without an active exception"), with either implementation; the results are out
    sys.stdout.flush()
    os._exit(0)


def launch(impl: str, args: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).resolve()), "--worker", "--impl", impl,
           *[f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "batch", "seq", "vocab", "dim",
                                                   "heads", "layers", "ffn")]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    results = json.loads(lines[0].split(" ", 1)[1]) if lines else []
    if proc.returncode != 0 or len(results) != 2:
        raise SystemExit(f"{impl} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each runs both)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=["shardkit", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    runs: dict[str, list[list[dict]]] = {"shardkit": [], "torch": []}
    for round_index in range(args.rounds):
        order = ("shardkit", "torch") if round_index % 2 == 0 else ("torch", "shardkit")
        for impl in order:
            runs[impl].append(launch(impl, args))
            print(f"round {round_index + 1}/{args.rounds}: {impl} "
                  f"{runs[impl][-1][0]['median_ms']:.1f} ms/step", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(runs, indent=1))

    def summary(impl: str) -> dict:
        rs = runs[impl]
        return {
            "first_ms": statistics.median(r[0]["first_ms"] for r in rs),
            "median_ms": statistics.median(r[0]["median_ms"] for r in rs),
            "per_round": [round(r[0]["median_ms"], 1) for r in rs],
            "hwm": [statistics.median(r[k]["hwm_mib"] for r in rs) for k in range(2)],
            "growth": [statistics.median(r[k]["step_growth_mib"] for r in rs) for k in range(2)],
            "heap": [statistics.median(r[k]["heap_peak_mib"] for r in rs) for k in range(2)],
        }

    ours, theirs = summary("shardkit"), summary("torch")
    params = runs["shardkit"][0][0]["params"]
    print(f"\nTransformer {params / 1e6:.1f}M params, 2 gloo ranks x 1 thread, batch {args.batch}x{args.seq} per rank, "
          f"AdamW + clip_grad_norm_; {args.rounds} interleaved rounds, {args.warmup} warm-up + {args.steps} timed "
          "steps each; medians over rounds\n")
    header = f"{'':<24}{'shardkit':>12}{'torch':>12}{'ratio':>9}"
    print(header)
    print("-" * len(header))

    def row(label: str, a: float, b: float, fmt: str = "{:.1f}") -> None:
        print(f"{label:<24}{fmt.format(a):>12}{fmt.format(b):>12}{a / b:>9.3f}")

    row("ms/step (median)", ours["median_ms"], theirs["median_ms"])
    row("first step ms", ours["first_ms"], theirs["first_ms"])
    for k in range(2):
        row(f"peak RSS rank {k} MiB", ours["hwm"][k], theirs["hwm"][k])
    for k in range(2):
        row(f"RSS growth rank {k} MiB", ours["growth"][k], theirs["growth"][k])
    for k in range(2):
        row(f"peak heap rank {k} MiB", ours["heap"][k], theirs["heap"][k], "{:.2f}")
    print(f"\nper-round ms/step: shardkit {ours['per_round']}  torch {theirs['per_round']}")


if __name__ == "__main__":
    main()
