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
import subprocess
import sys

# this checkout's shardkit first, then the modules beside this file (they import shardkit: keep this order)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_jobs as jobs  # noqa: E402 - the jobs of a repetition
import checkpoint_targets as targets  # noqa: E402 - the targets and definitions shared with save_load_minimal
import checkpoint_training as training  # noqa: E402 - the training-while-saving phase
from checkpoint_report import report  # noqa: E402 - the save/load/async tables
from checkpoint_state import build_state, local_sums, shapes_for, zero_state  # noqa: E402, F401 - replicated_load's

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
        {"ws2": jobs.worker_two_ranks, "ws1": jobs.worker_one_process, "train": jobs.worker_training}[args.worker](args)
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


if __name__ == "__main__":
    main()
