"""A cold load's read path, before and after, in one run: shardkit's reads as they are, shardkit's reads as
they were (a descriptor per read step, one request per I/O thread at a time), DCP and a raw read.

    python benchmarks/load_reads.py --size 50MB --rounds 9          # 2-rank loads, then the 1-process reshard
    python benchmarks/load_reads.py --size 300MB --rounds 7 --only two

``two``: a 2-rank ``torchrun`` job (gloo) holds the model under ``shardkit.fully_shard`` and torch's
``fully_shard`` (as ``peers.py`` builds it), saves it once with shardkit and DCP and writes each rank's shards
to a raw file (fsynced), then loads each ``--rounds`` times, every system in every round, in an order that
flips each round; before each load the page cache is dropped (``drop_caches``; root) and the job sleeps
``--cold-sleep`` s.  ``one``: a 1-process job loads the same 2-rank checkpoints into the unsharded model (the
resharding load; raw reads both ranks' files front to back).  A time is the slowest rank's between
barriers; the figure the median.  "before" is this checkout with the read path of ``LocalDisk`` and
``NativeReader.read`` put back as it was (``LocalDisk.files_held_open`` a no-op, one run per request), so
the two differ in that alone.  Every shardkit load is checked against the saved values (exact sums).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

SYSTEMS = ("after", "before", "dcp", "raw")


@contextlib.contextmanager
def reads_as_before() -> Iterator[None]:
    """The local read path as it was: a descriptor per read step, requests handed to threads one by one
    (``reader``'s own name for :func:`~shardkit.checkpoint.formats.native.chunk_reads.read_runs` is replaced)."""
    from shardkit.checkpoint.formats.native import reader
    from shardkit.checkpoint.io.local_disk import LocalDisk

    held, runs = LocalDisk.__dict__["files_held_open"], reader.read_runs
    LocalDisk.files_held_open = staticmethod(contextlib.nullcontext)
    reader.read_runs = lambda sizes, lanes: [(i, i + 1) for i in range(len(sizes))]
    try:
        yield
    finally:
        LocalDisk.files_held_open, reader.read_runs = held, runs


def sums(state: dict[str, Any]) -> list[float]:
    import peers_systems as ps

    return [float(ps.local(t).double().sum()) for t in ps.tensors(state).values()]


def zero(state: dict[str, Any]) -> None:
    import peers_systems as ps

    for t in ps.tensors(state).values():
        ps.local(t).zero_()


def measure(args: argparse.Namespace, loads: dict[str, Callable[[], None]], check: Callable[[str], None],
            world: int) -> dict[str, list[float]]:
    import checkpoint_targets as targets
    import torch
    import torch.distributed as dist

    times: dict[str, list[float]] = {s: [] for s in loads}
    rank = dist.get_rank() if world > 1 else 0
    for r in range(args.rounds + 1):  # the first round is a warm-up, not kept
        for s in (list(loads) if r % 2 == 0 else list(loads)[::-1]):
            if rank == 0:
                targets.drop_page_cache()
            if world > 1:
                dist.barrier()
            time.sleep(args.cold_sleep)
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            loads[s]()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            if world > 1:
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
            check(s)
            if r:
                times[s].append(float(took))
    return times


def worker(args: argparse.Namespace) -> None:
    import peers_measure as pm
    import peers_systems as ps
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import shardkit.checkpoint as skc

    torch.set_num_threads(1)
    two = args.worker == "two"
    world = 1
    if two:
        dist.init_process_group("gloo")
        world = dist.get_world_size()
    runtime = "shardkit" if two else None
    models = {"shardkit": ps.build(args.size, runtime), "torch": ps.build(args.size, "torch" if two else None)}
    states = {"shardkit": ps.state_of("shardkit", *models["shardkit"]), "dcp": ps.state_of("dcp", *models["torch"])}
    where = {s: os.path.join(args.dir, s) for s in ("shardkit", "dcp", "raw")}
    if two:
        rank = dist.get_rank()
        if rank == 0:
            os.makedirs(where["raw"], exist_ok=True)
        dist.barrier()
        skc.save(states["shardkit"], where["shardkit"])
        dcp.save(states["dcp"], checkpoint_id=where["dcp"])
        pm.raw_write(states["shardkit"], os.path.join(where["raw"], f"rank{rank}.bin"))
        dist.barrier()
        raw_files = [os.path.join(where["raw"], f"rank{rank}.bin")]
    else:
        raw_files = sorted(os.path.join(where["raw"], f) for f in os.listdir(where["raw"]))
    expected = {"shardkit": sums(states["shardkit"]), "dcp": sums(states["dcp"])}
    if not two:  # the unsharded model holds other values than the saved ones: load once, keep what it gave
        skc.load(states["shardkit"], where["shardkit"])
        dcp.load(states["dcp"], checkpoint_id=where["dcp"])
        expected = {"shardkit": sums(states["shardkit"]), "dcp": sums(states["dcp"])}

    def shardkit_load(before: bool) -> Callable[[], None]:
        def load() -> None:
            zero(states["shardkit"])
            with reads_as_before() if before else contextlib.nullcontext():
                skc.load(states["shardkit"], where["shardkit"])
        return load

    def dcp_load() -> None:
        zero(states["dcp"])
        dcp.load(states["dcp"], checkpoint_id=where["dcp"])

    import checkpoint_targets as targets

    loads = {"after": shardkit_load(False), "before": shardkit_load(True), "dcp": dcp_load,
             "raw": lambda: targets.read_sequentially(raw_files)}

    def check(system: str) -> None:
        state = "dcp" if system == "dcp" else "shardkit"
        if system != "raw" and sums(states[state]) != expected[state]:
            raise SystemExit(f"{system}: the load does not give back the saved values")

    times = measure(args, loads, check, world)
    if not two or dist.get_rank() == 0:
        with open(os.path.join(args.dir, f"{args.worker}.json"), "w") as f:
            json.dump(times, f)
    if two:
        dist.barrier()
        dist.destroy_process_group()


def report(label: str, times: dict[str, list[float]]) -> None:
    med = {s: statistics.median(v) for s, v in times.items()}
    print(f"\n{label}: medians of {len(times['after'])} rounds (s), cold")
    print("  " + "  ".join(f"{s:>8s}" for s in SYSTEMS) + "   after/before  after/dcp  before/dcp  after/raw")
    print("  " + "  ".join(f"{med[s]:8.4f}" for s in SYSTEMS) + f"   {med['after'] / med['before']:11.2f}x"
          f"  {med['after'] / med['dcp']:8.2f}x  {med['before'] / med['dcp']:9.2f}x  {med['after'] / med['raw']:8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="50MB", help="state size, e.g. 50MB, 300MB")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cold-sleep", type=float, default=0.5)
    parser.add_argument("--only", choices=("two", "one"), default=None, help="one job alone")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--worker", choices=("two", "one"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    import peers_systems as ps

    if args.worker:
        args.size = ps.parse_size(args.size)
        worker(args)
        return
    work = tempfile.mkdtemp(prefix="shardkit-load-reads-", dir=args.dir)
    try:
        for job, n in (("two", 2), ("one", 1)):
            if args.only == "one" and job == "two":
                continue  # the 1-process job needs the 2-rank checkpoints: run "two" first
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                   os.path.abspath(__file__), "--worker", job, "--size", args.size, "--rounds", str(args.rounds),
                   "--cold-sleep", str(args.cold_sleep), "--dir", work] if job == "two" else [
                   sys.executable, os.path.abspath(__file__), "--worker", job, "--size", args.size, "--rounds",
                   str(args.rounds), "--cold-sleep", str(args.cold_sleep), "--dir", work]
            subprocess.run(cmd, check=True)
            with open(os.path.join(work, f"{job}.json")) as f:
                times = json.load(f)
            report(f"{args.size}, {'load at 2 ranks' if job == 'two' else 'load at 1 process (reshard)'}", times)
            if args.only == "two":
                break
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
