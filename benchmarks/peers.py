"""shardkit vs torch_checkpointing vs DCP: save, load, resharding load and async blocking, 5 MB to 1.4 GB.

For every size of ``--sizes`` (the state: a LLaMA-shaped stack of SwiGLU MLP blocks in fp32 plus AdamW's
two moments; :mod:`peers_systems` builds it and says how each system is configured and why), two jobs run:

* a 2-rank ``torchrun`` job (gloo, CPU) holding the model twice -- under ``shardkit.fully_shard`` for
  shardkit, under torch's ``fully_shard`` for DCP and torch_checkpointing -- that runs ``--warmup`` rounds
  (their figures are printed as "first call", not judged) and then ``--rounds`` rounds of, each op with the
  systems in an order that rotates from round to round: a **durable save** into a fresh directory (raw: each
  rank writes its shards to one file and fsyncs it); a **load at 2 ranks, cold** (the state zeroed, the page
  cache dropped -- ``sync`` + ``/proc/sys/vm/drop_caches``, or ``posix_fadvise(DONTNEED)`` on the files
  where that is not writable -- then ``--cold-sleep`` s; raw: each rank reads its file back front to back);
  an **async save**, its blocking time (the wait for the commit is untimed);
* a 1-process job (``torchrun`` with one rank) holding the model unsharded, that loads the last 2-rank
  checkpoints of every system ``--rounds`` times, cold (a **resharding load**; raw: one process reads both
  rank files).

Every time is the slowest rank's, between barriers; a figure is the median over the rounds.  Every load is
checked: per tensor, the float64 sum of what each rank held at save time against the sum of the same rows
after the load, exactly.  Verdicts: shardkit / the best peer (the faster of DCP and torch_checkpointing) <=
1.0x in every cell; from 300 MB on, save and 2-rank load <= 1.1x raw.

The floor of a load.  From 300 MB on the 2-rank load also times **raw into tensors**: each rank reads its raw
file straight into its preallocated local tensors (``preadv`` into their memory, no checksum), on as many
threads as shardkit's load reads with, each a consecutive run of the file, checked like every load.  The
2-rank load's raw target is judged against it, and the plain raw read is printed beside it: that read fills
one reused 8 MiB buffer that stays in the CPU's caches and writes the bytes nowhere, so it leaves out what
every loader must do -- put each byte into the target's memory (hundreds of MB of stores through the memory
bus, a cache miss per line).  The same bytes, read by the same ranks into the same tensors, are the fair
floor of a load; the raw read stays as the disk's.  (On the CPU: with ``--device cuda`` the tensors are on
the GPUs, and the raw read stays the load's floor.)

This file is the command line and the driver; the timing and checks on the ranks are :mod:`peers_measure`'s,
the two jobs :mod:`peers_jobs`'s, the table and verdicts :mod:`peers_report`'s.
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

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import checkpoint_targets as targets  # noqa: E402 - beside this file
import peers_systems as ps  # noqa: E402
from peers_jobs import OPS, worker_one, worker_two  # noqa: E402
from peers_report import print_figures, report  # noqa: E402

# -- the driver ----------------------------------------------------------------------------------------------------


def run_size(args: argparse.Namespace, size: float) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="shardkit-peers-", dir=args.dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = [os.path.abspath(__file__), "--size-bytes", str(size), "--dir", work, "--rounds", str(args.rounds),
              "--warmup", str(args.warmup), "--cold-sleep", str(args.cold_sleep), "--tc-durable", args.tc_durable,
              "--device", args.device, "--ops", ",".join(args.ops), *(["--tc-direct-io"] if args.tc_direct_io else [])]
    try:
        for n, worker in ((args.world, "two"), (1, "one")) if "load1" in args.ops else ((args.world, "two"),):
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                            *common, "--worker", worker], check=True, env=env)
        with open(os.path.join(work, "ws2.json")) as f:
            result = json.load(f)
        if "load1" in args.ops:
            with open(os.path.join(work, "ws1.json")) as f:
                for row, extra in zip(result["rounds"], json.load(f)):
                    row.update(extra)
        result.pop("expected")
        result["world"] = args.world
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, else ``sys.argv``); what ``main`` and the workers run on."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="5MB,50MB,300MB,1.4GB", help="state sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=targets.MIN_ROUNDS, help="judged rounds per size")
    parser.add_argument("--warmup", type=int, default=1, help="rounds first, shown as 'first call', not judged")
    parser.add_argument("--cold-sleep", type=float, default=2.0, help="seconds asleep after dropping the page "
                        "cache, before a cold load (the VM hands freed memory back)")
    parser.add_argument("--tc-durable", choices=("fsync", "sync"), default="fsync", help="how torch_checkpointing's "
                        "save is made durable: fsync of its files and directories, or os.sync()")
    parser.add_argument("--dir", default=os.environ.get("TMPDIR", "/var/tmp"), help="where checkpoints are written")
    parser.add_argument("--json", default=None, help="also keep the raw results here")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo, 2 ranks; cuda: NCCL, "
                        "one GPU per rank, min(2, GPUs) ranks, pinned staging for every system")
    parser.add_argument("--ops", default=",".join(op for op, _ in OPS), help="the cells to measure, comma-separated, "
                        "of save, load2 (2-rank load), load1 (resharding load) and async; the save always runs (the "
                        "loads read what it wrote), e.g. --ops save,load2 for the 2-rank load alone")
    parser.add_argument("--worker", choices=("two", "one"), help=argparse.SUPPRESS)
    parser.add_argument("--size-bytes", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--tc-direct-io", action="store_true", help=argparse.SUPPRESS)  # decided by main()
    args = parser.parse_args(argv)
    known = [op for op, _ in OPS]
    asked = [op.strip() for op in args.ops.split(",") if op.strip()]
    if set(asked) - set(known):
        parser.error(f"--ops: unknown {sorted(set(asked) - set(known))}; choose from {', '.join(known)}")
    args.ops = [op for op in known if op == "save" or op in asked]
    if not args.worker:
        for text in args.sizes.split(","):
            try:
                ps.parse_size(text)
            except ValueError as exc:
                parser.error(f"--sizes: {exc}")
    return args


def cuda_world() -> int:
    """The sharded job's ranks on CUDA: 2, or 1 on a machine with one GPU; exits saying why without CUDA."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                         "run it on a GPU machine (benchmarks/gpu_check.sh does), or with --device cpu")
    return min(2, torch.cuda.device_count())


def main() -> None:
    args = parse_args()
    if args.worker:
        args.size = args.size_bytes
        (worker_two if args.worker == "two" else worker_one)(args)
        return
    args.world = 2
    if args.device == "cuda":
        args.world = cuda_world()
        args.tc_direct_io = ps.tc_direct_io_works(args.dir)
        print(f"CUDA: {torch.cuda.device_count()} GPU(s) ({torch.cuda.get_device_name(0)}), the sharded job at "
              f"{args.world} rank(s); torch_checkpointing direct I/O in {args.dir}: "
              f"{'on' if args.tc_direct_io else 'off (its O_DIRECT write is refused here)'}", flush=True)
    results = {}
    for text in args.sizes.split(","):
        results[text] = run_size(args, ps.parse_size(text))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    verdicts = report(results, args)
    targets.print_verdicts(verdicts, args.rounds)
    if args.device == "cuda":
        print_figures(verdicts, args.world)


if __name__ == "__main__":
    main()
