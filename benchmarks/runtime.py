"""shardkit's fully_shard against torch's own fully_shard: time per step and
peak memory, gloo ranks on the CPU, measured in one run, interleaved.

    python benchmarks/runtime.py                # 1-D FSDP on 2 ranks; launches the ranks itself
    python benchmarks/runtime.py --steps 30 --rounds 5 --json
    python benchmarks/runtime.py --tp 2         # 2-D: TP inside the blocks x FSDP, (dp 2, tp 2) on 4 ranks
    python benchmarks/runtime.py --device cuda --world 1 --rounds 0   # NCCL, one rank per GPU, phase 1 only

With ``--device cuda`` the ranks use NCCL, one GPU each (``--world`` of them,
at most ``torch.cuda.device_count()``), and the step's memory is the peak of
CUDA memory allocated during it above its start instead of malloc's.

With ``--tp N`` every block is tensor-parallel over N ranks (q/k/v and the
first MLP layer column-wise, the attention output and the second MLP layer
row-wise) and FSDP shards over the other dim; the TP peers of a dp rank
train on the same batch, and both sides clip with ``shardkit.clip_grad_norm_``
(torch's own cannot mix the 2-D and 1-D gradients).

The same model (the test suite's Transformer, scaled up), the same seed, the
same batches and the same AdamW + clip_grad_norm_ step under both.  Two phases:

1. **Time, step-interleaved.**  One 2-rank job builds both models and
   alternates single training steps between them (which one goes first
   flips every step), so both see the same machine load.  Per step:
   wall time (the slowest rank; steps start on a barrier), CPU time of the
   process (all threads), and the peak of bytes held by malloc during that
   step above its start (glibc ``mallinfo2``, sampled every 0.5 ms): the
   step's transient memory, which is what the runtime controls.
2. **Cold start and peak RSS, fresh processes.**  ``--rounds`` alternating
   2-rank jobs per implementation, each building one model and training; we
   report the first step's wall time (cold: lazy init, first allocations,
   first dispatch of every op), the process high-water mark (``VmHWM``) per
   rank, which also includes importing torch and building the model
   (identical for both), and the peak of bytes malloc held *in use* over the
   whole job (sampled as in phase 1).  The high-water mark also counts memory
   glibc keeps after a free (tens of MiB that differ between identical jobs
   of either implementation); the in-use peak is what the runtime asked for
   and repeats to the KiB.

Phase 1 also times shardkit with debug mode on (``shardkit.set_debug(True)``:
a fingerprint all-gather before each collective) as a third interleaved
model, and reports its ratio to shardkit without it (target: <= 1.10).

Medians everywhere, and the ratios shardkit / torch (target: <= 1.0).  On this
shared 2-core VM wall times swing by +-30% between runs; the CPU time and the
heap figures are the stable ones.

This file is the command line and the driver; the ranks' jobs are
:mod:`runtime_job`'s, their memory meters :mod:`runtime_meters`'s, the table
and targets :mod:`runtime_report`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_job import IMPLS, REPO, worker_interleaved, worker_memory  # noqa: E402 - beside this file
from runtime_report import report  # noqa: E402

_MODEL_FLAGS = ("warmup", "batch", "seq", "vocab", "dim", "heads", "layers", "ffn", "tp", "device")


def launch(args: argparse.Namespace, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           str(Path(__file__).resolve()), *extra, *[f"--{k}={getattr(args, k)}" for k in _MODEL_FLAGS]]
    # this checkout first, and whatever the caller's PYTHONPATH holds (packages installed beside it) after
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"run {extra} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return sorted(json.loads(lines[0].split(" ", 1)[1]), key=lambda r: r["rank"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, else ``sys.argv``), checked; what ``main`` runs on."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per implementation (phase 1)")
    parser.add_argument("--rounds", type=int, default=5, help="fresh-process rounds per implementation (phase 2)")
    parser.add_argument("--memory-steps", type=int, default=5, help="steps per fresh-process round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size: 2 runs (dp 2, tp 2) on 4 ranks")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: gloo ranks; cuda: NCCL ranks, one GPU each")
    parser.add_argument("--world", type=int, default=0,
                        help="ranks of the job (default: 2 x --tp); with --device cuda at most the GPUs there are")
    parser.add_argument("--json", action="store_true", help="also print the raw results as JSON")
    parser.add_argument("--worker", choices=["interleaved", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.ranks = args.world or 2 * args.tp  # by default two data-parallel ranks, each a group of tp ranks
    if args.ranks % args.tp:
        parser.error(f"--world {args.ranks} is not a multiple of --tp {args.tp}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker == "interleaved":
        return worker_interleaved(args)
    if args.worker == "memory":
        return worker_memory(args)

    print("phase 1: both implementations (and shardkit in debug mode) in one job, steps interleaved ...",
          file=sys.stderr, flush=True)
    timing = launch(args, "--worker=interleaved", f"--steps={args.steps}")
    memory: dict[str, list[list[dict]]] = {impl: [] for impl in IMPLS}
    for round_index in range(args.rounds):
        for impl in (IMPLS if round_index % 2 == 0 else IMPLS[::-1]):
            print(f"phase 2: round {round_index + 1}/{args.rounds}, {impl} ...", file=sys.stderr, flush=True)
            memory[impl].append(launch(args, "--worker=memory", f"--impl={impl}",
                                       f"--memory-steps={args.memory_steps}"))
    if args.json:
        print(json.dumps({"timing": timing, "memory": memory}, indent=1))

    report(args, timing, memory)


if __name__ == "__main__":
    main()
