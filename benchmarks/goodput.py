"""Goodput: the training time each checkpointing system costs, and the work a failure loses.

One ``--ranks``-rank ``torchrun`` job (gloo, CPU; 2 by default; :mod:`goodput_job`) trains a small Transformer
(``tests/support/models.py``; AdamW; its size from ``--sizes``: weights + two moments) for ``--steps`` steps
per arm, ``--rounds`` times, the arms in an order that rotates from round to round. The model is held twice:
under ``shardkit.fully_shard`` for the shardkit arms and the shardkit baseline, under torch's ``fully_shard``
for DCP, torch_checkpointing and the torch baseline (:mod:`peers_systems` configures the systems and says
why). Arms (:mod:`goodput_saver` saves for each):

* ``none/shardkit``, ``none/torch``: no checkpoint, each runtime's baseline;
* ``shardkit-async``: ``shardkit.checkpoint.async_save`` every ``--every`` steps;
* ``shardkit-hot``: ``CheckpointManager(async_save=True, local=/dev/shm/..., local_world_size=1,
  replicas=1, durable_every=--every)`` -- ``save`` every step: the hot tier (node-local copy + a replica
  on the other rank, playing the other node) every step, durable every ``--every``;
* ``dcp-async``: ``dcp.async_save`` (its thread) every ``--every`` steps;
* ``torch_checkpointing-async``: its async ``CheckpointManager`` every ``--every`` steps, ``optimizer.step()``
  inside ``manager.lock()`` as its docs ask (its staging overlaps the next forward and backward).

Every save is handed the state dict taken at that step (``get_training_state`` / ``get_state_dict``), on the
clock; a save starts only after the previous one of the arm committed, and that wait is on the clock too.
Each measure of an arm first saves once, untimed and waited for, so writer processes exist and staging
buffers are allocated: the steady state of a long run (torch_checkpointing's first async save spawns its
writer: seconds).  Each runtime first trains 12 steps, untimed, before any arm.

**The judged measure: paired blocks.**  An arm's ``--steps`` steps are cut into blocks of ``--every`` steps.
An arm block opens with the save of the state as it stands (the hot arm also saves after each of the block's
steps but the last, whose save opens the next block) and closes with the wait for that save to commit: the
wait the next save of a continuous run starts with.  Each arm block is paired with a baseline block -- the
same ``--every`` steps on the same batches and the same model, without saves -- run right before or after it,
the order alternating from block to block and round to round, a barrier (off the clock) before every block;
a block's time is its slowest rank's.  Overhead = (sum of the arm blocks - sum of the baseline blocks) / sum of
the baseline blocks, the median over the rounds; the report gives one standard error beside it, from the spread
of the paired differences.  Why: on a shared machine the load drifts by more than the effect over the minute
that separates two whole runs (one round here saw a baseline move from 11.9 s to 13.1 s between arms), while
the two blocks of a pair are seconds apart and the alternating order cancels a steady drift.  Fair to each
system because:

* the baseline blocks train *the same model* the arm saves, not a copy: the steps cost what the arm's steps
  would without saving (same tensors, same memory and cache footprint, same allocator state), where a copy
  would double the state held and train memory the saves never read.  It changes only the values a save
  reads, never what the save costs (no option here compresses, deduplicates or digests by value): a baseline
  block starts only after the arm block before it waited for its save to commit, and a save reads the state
  at its block's start.  The resume check (below) checks whatever that model holds at the end;
* every system's save is over, by its own future, when its arm block ends: shardkit's ``async_save`` future
  completes at the commit (files and directories fsynced), DCP's after its writes and metadata,
  torch_checkpointing's write future when its files are written -- *not* durable: it never fsyncs, so its
  dirty pages are written back by the kernel later, outside its blocks (an advantage to it, left as it is,
  and the reason each arm ends with an untimed ``os.sync()``, so that write-back never lands in the next
  arm's blocks) -- the hot manager's after retention (and ``wait()``).  Work a system does after its own
  future completed lands in the block that follows, an arm block or a baseline block alternately, so it
  adds to both sums alike and is not counted: on this machine a few milliseconds of DCP's clean-up;
* torch_checkpointing's staging overlaps the block's first forward and backward and its ``optimizer.step()``
  waits in ``manager.lock()`` until staging is done, as in a continuous run; the baseline blocks take no lock;
* the quantity is a long run's steady state: every save overlaps ``--every`` steps.  A whole run of
  ``--steps`` steps also pays its last save's whole lag after its last step (no steps to overlap: the
  "tail"), an end effect of its length that the blocks leave out.

After the blocks, untimed, the final state is saved; then, timed as "resume", the state is snapshotted,
zeroed, loaded back from that checkpoint with the system's own load, and compared bitwise with the snapshot.

**Beside it, not judged: whole runs** (the earlier measure; ``--blocks-only`` leaves it out, halving the
time).  The arm's ``--steps`` steps in one run (the last step a save, its wait on the clock) and its
runtime's baseline as a separate whole run before it in even rounds, after it in odd ones; overhead = wall /
the baseline's wall - 1, the median over the rounds; the same resume check.  Per step, too: every step's time
(the save it starts included; the max over the ranks) is kept, and for the arms that save every ``--every``
steps the report gives the step time each save costs -- the excess of the save's step and the 3 after it over
the median of the 5 steps before it (median over saves and rounds), the same steps of the paired baseline
beside it (the noise floor) -- the wait for the last save, and an overhead rebuilt from those.

Work lost per failure, one failure every ``--fail-every`` steps: a failure at a random moment redoes on
average half the interval between saves plus the lag from a save's start to its commit (measured, median),
then pays the resume (measured); per ``--fail-every`` steps the arm also pays its overhead (taken as 0 where
the measured one is negative: noise).

Targets, on the paired blocks' overheads: ``shardkit-async`` <= 0.5x ``dcp-async``'s and <= 1.0x
torch_checkpointing's.

    python benchmarks/goodput.py                               # 50MB of state, 60 steps, 5 rounds
    python benchmarks/goodput.py --sizes 5MB --rounds 1        # smoke run
    python benchmarks/goodput.py --blocks-only                 # the judged measure alone
    python benchmarks/goodput.py --report kept.json            # the report of a run kept with --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

# this checkout's shardkit first, then the modules beside this file (they import shardkit: keep this order)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_targets as targets  # noqa: E402 - beside this file
import goodput_job as job  # noqa: E402 - the training job
import goodput_report  # noqa: E402 - its tables and verdicts
import peers_systems as ps  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="50MB", help="state sizes (weights + AdamW), comma-separated")
    parser.add_argument("--rounds", type=int, default=targets.MIN_ROUNDS)
    parser.add_argument("--ranks", type=int, default=2, choices=(2, 3, 4), help="ranks of the training job")
    parser.add_argument("--steps", type=int, default=60, help="training steps per arm (a multiple of --every)")
    parser.add_argument("--every", type=int, default=10, help="steps between (durable) saves: one block")
    parser.add_argument("--batch", type=int, default=8, help="sequences of 64 tokens per rank and step")
    parser.add_argument("--fail-every", type=int, default=100, help="steps between failures (work lost)")
    parser.add_argument("--blocks-only", action="store_true", help="the paired blocks (judged) alone, without "
                        "the whole runs beside them")
    parser.add_argument("--json", default=None, help="also keep the raw results here")
    parser.add_argument("--report", default=None, metavar="JSON", help="run nothing: print the report of the "
                        "results an earlier run kept with --json (the same --steps, --every and --ranks)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size-bytes", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--shm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps % args.every:
        parser.error("--steps must be a multiple of --every (whole blocks; a whole run's last step is a save)")
    if args.worker:
        args.size = args.size_bytes
        job.worker(args)
        return
    if args.report:
        with open(args.report) as f:
            kept = json.load(f)
        verdicts = [v for size, res in kept.items() for v in goodput_report.report(size, res, args)]
        targets.print_verdicts(verdicts, min(len(res["rounds"]) for res in kept.values()))
        return
    print("configuration\n" + ps.CONFIGURATION)
    targets.judge_sizes(args.sizes, lambda size: one_size(args, size),
                        lambda size, res: goodput_report.report(size, res, args), args.rounds, args.json)


def one_size(args: argparse.Namespace, size: str) -> dict[str, Any]:
    """One size's results: the training job under torchrun in a fresh work and shared-memory directory."""
    work = tempfile.mkdtemp(prefix="shardkit-goodput-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    shm = tempfile.mkdtemp(prefix="shardkit-goodput-", dir="/dev/shm")
    try:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={args.ranks}", os.path.abspath(__file__), "--worker",
                        "--size-bytes", str(ps.parse_size(size)),
                        "--dir", work, "--shm", shm, "--rounds", str(args.rounds), "--steps", str(args.steps),
                        "--every", str(args.every), "--batch", str(args.batch)]
                       + (["--blocks-only"] if args.blocks_only else []),
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(os.path.join(work, "result.json")) as f:
            return json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
