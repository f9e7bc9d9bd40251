"""The hot tier: what a save every step costs the training loop, and how fast a job recovers from each tier.

One 4-rank job (``torchrun``, gloo on CPU) plays 2 nodes of 2 (``local_world_size=2``): a stack of
``--layers`` square linear layers of width ``--dim`` (shardkit ``fully_shard`` per layer and at the root)
with AdamW's state, about ``--gb`` GB in all (weights + two moments).  The hot tier lives under
``/dev/shm`` (a directory per node), the durable roots and DCP's checkpoint on local disk under a
temporary directory.  ``--rounds`` rounds run the arms of each measurement interleaved (their order
rotates from round to round); every figure is a median over the rounds of the slowest rank.

1. **Blocking time per hot save** (``async_save=True``, a step that is not durable): the wall time of
   ``manager.save`` on the training thread (state dict, RNG, the copy into the reused host buffers, the
   hand-off to the background thread), beside a plain copy of the same local tensors into buffers
   allocated once before the rounds.  Target: <= 1.2x the copy.  The blocking time of a hot save that is
   also durable and of the durable manager's own async save are shown beside it.
2. **Step time while a hot save replicates**: a compute step of fixed cost (``--compute-iters`` matmuls
   of 512x512, one thread) is timed alone, then run back to back after ``save`` returns until the save's
   future completes; the steps that started while it was in flight are the "during" figure.  The
   background time (from ``save``'s return until its future completes) is recorded too.
3. **Recovery time** of ``load_latest`` in a fresh manager (a restarted job), the targets zeroed first and
   compared bitwise after with the copy arm's buffers (the state never changes): from the local tier (all
   intact: ``source == "local"``), from peers (node 1's directory moved away: ``"peer"``), from the
   durable root through the hot manager (both node directories moved away: ``"durable"``), the durable
   manager's load (no ``local=``), and torch DCP's ``dcp.load`` of the same state from the same disk;
   beside them the floor, the durable step's files read cold by the 4 ranks (a quarter each, nothing
   checked), and the floors of the hot recoveries (:mod:`peers_hot_floors`, which says why each is what it
   is), in the same rounds: each rank reading its own copy's files from its node's directory into a buffer of
   their size (``raw-local``), and node 0's ranks sending the bytes of node 1's ranks to them over gloo, one
   pair per lost rank, nothing else (``raw-transfer``: issue 40's floor, "a raw gloo transfer of the same
   bytes between the same ranks"); beside those, shown and not judged, the local read into one reused 8 MiB
   buffer (``raw-local-reused``) and the transfer while node 0's ranks read their own copies as ``raw-local``
   does (``raw-peer``: everything a recovery from peers does on every rank, raw).  Before the durable,
   DCP and raw-disk loads the files are evicted from the page cache:
   ``/proc/sys/vm/drop_caches`` when writable, else ``posix_fadvise(DONTNEED)`` on every file after
   ``sync`` (the report says which).  Every recovery starts after a 4 s pause, so the VM has handed
   freed memory back (what a restarted process sees).  A load's time is the job's, from the last rank's
   start to the last rank's end (:func:`hot_tier_job.job_wall` says why); the slowest rank's own time is kept too
   (``rank_s``), and the floor ratios on it are printed beside the targets.
   Targets: local <= 0.5x and peer <= 0.7x the durable manager's load; local <= 1.5x ``raw-local`` and
   peer <= 1.5x ``raw-transfer`` (their floors).
4. **Work lost per failure**, computed from the medians above for a run that fails every M steps (a node
   lost) and steps of ``T`` seconds without saving (the compute step measured alone, and ``--step-s``).
   One save (blocking ``b``, background ``B``, compute ``rho`` times slower while it runs) at the start of
   ``c`` seconds of compute makes them take ``b + max(c + B * (1 - 1/rho), B)`` (the next save waits for
   the last).  Hot every step + durable every 10: 9 hot saves and 1 hot+durable save per 10 steps of
   ``c = T``, recovery from peers; durable every 10 (the durable manager, async): one save per ``c = 10 T``,
   recovery from the durable root.  A save is usable ``b + B`` after the state it holds was taken, so a
   failure at a uniformly random moment loses ``b + B + I/2`` of work on average (``I`` the time between
   saves), and the time lost per failure is that, plus the recovery, plus the saving overhead paid over
   the M steps since the last failure (``M * (mean step - T)``).

    python benchmarks/hot_tier.py                 # ~0.8 GB, 5 rounds
    python benchmarks/hot_tier.py --quick         # a small state, 2 rounds (a smoke run)
    python benchmarks/hot_tier.py --sizes 5MB --rounds 1   # the smallest smoke run
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
import hot_tier_job as job  # noqa: E402 - the 4-rank job
import hot_tier_report  # noqa: E402 - its tables and verdicts

# -- the driver --------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small state and 2 rounds (a smoke run)")
    parser.add_argument("--gb", type=float, default=0.8, help="state in all (weights + AdamW), GB")
    parser.add_argument("--sizes", default=None, help="the state in all as a size, e.g. 5MB (one size; "
                        "instead of --gb)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=6, help="more interleaved samples per round of measurement "
                        "1's copy and hot save (their blocking medians are over every sample)")
    parser.add_argument("--compute-iters", type=int, default=12, help="512x512 matmuls in one compute step")
    parser.add_argument("--fail-every", default="100,1000", help="M: steps between failures, comma-separated")
    parser.add_argument("--step-s", default="2,10", help="step times (s) to model measurement 4 for, besides "
                        "the measured compute step, comma-separated")
    parser.add_argument("--json", default=None, help="also keep the raw results here")
    parser.add_argument("--report", default=None, metavar="JSON", help="run nothing: print the report of the "
                        "results an earlier run kept with --json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shm", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job.worker(args)
        return
    if args.report:
        with open(args.report) as f:
            out = json.load(f)
    else:
        out = run_job(args)
    targets = hot_tier_report.report(out, [int(m) for m in args.fail_every.split(",")],
                                     [float(t) for t in args.step_s.split(",") if t])
    hot_tier_report.print_targets(targets)


def run_job(args: argparse.Namespace) -> dict[str, Any]:
    """The 4-rank job under torchrun; its results (kept in ``--json`` when given)."""
    if args.quick:
        args.gb, args.rounds = 0.02, 2
    elif args.sizes:
        import peers_systems

        args.gb = peers_systems.parse_size(args.sizes) / 1e9
    dim = 2048 if args.gb >= 0.2 else 512
    layers = max(1, round(args.gb * 1e9 / (12 * dim * dim) + 0.499))  # rounded up: at least --gb
    work = tempfile.mkdtemp(prefix="shardkit-hot-bench-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    shm = tempfile.mkdtemp(prefix="shardkit-hot-bench-", dir="/dev/shm")
    try:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                   os.path.abspath(__file__), "--worker", "--dim", str(dim), "--layers", str(layers),
                   "--rounds", str(args.rounds), "--pairs", str(args.pairs), "--compute-iters", str(args.compute_iters),
                   "--dir", work,
                   "--shm", shm]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(os.path.join(work, "result.json")) as f:
            out = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
