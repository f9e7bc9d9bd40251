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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import checkpoint_targets as targets  # noqa: E402 - beside this file
import peers_systems as ps  # noqa: E402

OPS = (("save", "save, durable"), ("load2", "load, 2 ranks, cold"), ("load1", "load at 1 process (reshard), cold"),
       ("async", "async save, blocking"))
RAW_FROM = 300e6  # the raw targets count from this size on
RAW_LIMIT, PEER_LIMIT = 1.1, 1.0
DEVICE = "cpu"  # the workers' device: set by join() from --device


# -- measuring ---------------------------------------------------------------------------------------------------


def join(args: argparse.Namespace) -> None:
    """Join the job: gloo on the CPU, or NCCL with this rank's GPU (``LOCAL_RANK``) for ``--device cuda``."""
    global DEVICE
    torch.set_num_threads(1)
    DEVICE = args.device
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")


def sync_device() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def evict(paths: list[str], rank: int) -> str:
    """Drop the page cache (rank 0) before a cold load; how: ``drop_caches`` or ``fadvise`` on ``paths``."""
    how = ""
    if rank == 0:
        how = "drop_caches" if targets.drop_page_cache() else "fadvise"
        for path in paths if how == "fadvise" else []:
            for name in [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] or [path]:
                fd = os.open(name, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
    dist.barrier()
    return how


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    sync_device()
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    sync_device()
    seconds = time.perf_counter() - start
    dist.barrier()
    return max_over_ranks(seconds), result


def rotated(items: tuple[str, ...], r: int) -> tuple[str, ...]:
    return items[r % len(items):] + items[:r % len(items)]


def rank_sums(state: dict[str, Any]) -> dict[str, tuple[int | None, float]]:
    """Per tensor: (rows this rank holds, or None for a plain tensor; the float64 sum of its local values)."""
    return {k: (ps.local(t).shape[0] if hasattr(t, "to_local") and t.dim() else None,
                float(ps.local(t).double().sum())) for k, t in ps.tensors(state).items()}


def zero(state: dict[str, Any]) -> None:
    for t in ps.tensors(state).values():
        ps.local(t).zero_()


def raw_read_into(state: dict[str, Any], path: str) -> None:
    """Read ``path`` (what :func:`raw_write` wrote) straight into ``state``'s local tensors, on as many threads
    as shardkit's load reads with (``DEFAULT_IO_THREADS``), each a consecutive run of the tensors through one
    descriptor front to back -- the read shardkit's load does, without its checksums."""
    from concurrent.futures import ThreadPoolExecutor

    from shardkit.checkpoint.io.concurrency import DEFAULT_IO_THREADS

    items, pos = [], 0
    for t in ps.tensors(state).values():
        target = ps.local(t)
        items.append((pos, target))
        pos += target.numel() * target.element_size()
    lanes = max(1, min(DEFAULT_IO_THREADS, len(items)))
    runs: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(lanes)]
    for offset, target in items:  # consecutive runs of about equal bytes
        runs[min(lanes - 1, offset * lanes // max(pos, 1))].append((offset, target))

    def read(run: list[tuple[int, torch.Tensor]]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, target in run:
                flat = target.reshape(-1) if target.is_contiguous() else torch.empty(target.numel(),
                                                                                      dtype=target.dtype)
                view = memoryview(flat.view(torch.uint8).numpy())
                done = 0
                while done < len(view):
                    got = os.preadv(fd, [view[done:]], offset + done)
                    if not got:
                        raise SystemExit(f"{path} ends before the state's bytes do")
                    done += got
                if flat.data_ptr() != target.data_ptr():
                    target.copy_(flat.view(target.shape))
        finally:
            os.close(fd)

    with ThreadPoolExecutor(lanes) as pool:
        list(pool.map(read, runs))


def raw_write(state: dict[str, Any], path: str) -> None:
    with open(path, "wb") as f:
        for t in ps.tensors(state).values():
            f.write(ps.local(t).contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
        f.flush()
        os.fsync(f.fileno())


# -- the 2-rank job ------------------------------------------------------------------------------------------------


def worker_two(args: argparse.Namespace) -> None:
    join(args)
    rank = dist.get_rank()
    peers = ps.Peers(args.tc_durable, async_group=dist.new_group(backend="gloo"), device=args.device,
                     tc_direct_io=args.tc_direct_io)
    models = {rt: ps.build(args.size, rt, device=args.device) for rt in ("shardkit", "torch")}
    states = {s: ps.state_of(s, *models[ps.runtime_of(s)]) for s in ps.SYSTEMS}
    states["raw"] = states["raw_into"] = states["shardkit"]
    # the floor of a load from RAW_FROM on: the raw file read straight into the tensors (the module docstring)
    into_tensors = args.device == "cpu" and ps.nbytes_of(states["shardkit"]) * dist.get_world_size() >= RAW_FROM
    expected = {s: rank_sums(states[s]) for s in ps.SYSTEMS}
    out: dict[str, Any] = {"rank_bytes": ps.nbytes_of(states["shardkit"]), "shape": ps.shape_for(args.size),
                           "rounds": [], "evicted_by": ""}

    def where(system: str, what: str) -> str:
        return os.path.join(args.dir, f"{system}-{what}") + (f"/rank{rank}.bin" if system == "raw" else "")

    def fresh(path: str) -> None:
        if rank == 0:
            shutil.rmtree(os.path.dirname(path) if path.endswith(".bin") else path, ignore_errors=True)
        dist.barrier()
        if path.endswith(".bin"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        dist.barrier()

    for r in range(args.warmup + args.rounds):
        row: dict[str, float] = {}
        for s in rotated((*ps.SYSTEMS, "raw"), r):
            fresh(where(s, "main"))
            path = where(s, "main")
            row[f"save/{s}"] = timed(lambda: raw_write(states[s], path) if s == "raw"
                                     else peers.save(s, states[s], path))[0]
        floors = ("raw", "raw_into") if into_tensors else ("raw",)
        for s in rotated((*ps.SYSTEMS, *floors), r) if "load2" in args.ops else ():
            if s != "raw":
                zero(states[s])
            raw = s in floors
            out["evicted_by"] = evict([os.path.dirname(where("raw", "main")) if raw else where(s, "main")], rank)
            time.sleep(args.cold_sleep)
            path = where("raw" if raw else s, "main")
            row[f"load2/{s}"] = timed(lambda: targets.read_sequentially([path]) if s == "raw"
                                      else raw_read_into(states[s], path) if s == "raw_into"
                                      else peers.load(s, states[s], path))[0]
            if s != "raw" and rank_sums(states[s]) != expected["shardkit" if raw else s]:
                raise SystemExit(f"{s}: the load at {dist.get_world_size()} rank(s) does not give back the saved "
                                 f"values (round {r})")
        for s in rotated(ps.SYSTEMS, r) if "async" in args.ops else ():
            path = where(s, "async")
            fresh(path)
            row[f"async/{s}"], wait = timed(lambda: peers.async_save(s, states[s], path))
            wait()
            dist.barrier()
        out["rounds"].append(row)
        if rank == 0:
            print(f"  {args.size / 1e6:g} MB, {dist.get_world_size()} rank(s): round {r + 1}/"
                  f"{args.warmup + args.rounds}", file=sys.stderr, flush=True)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, expected)
    if rank == 0:
        out["expected"] = gathered
        with open(os.path.join(args.dir, "ws2.json"), "w") as f:
            json.dump(out, f)
    peers.close()
    dist.barrier()
    dist.destroy_process_group()


# -- the 1-process job ---------------------------------------------------------------------------------------------


def check_full(state: dict[str, Any], per_rank: list[dict[str, list]], system: str) -> None:
    """The full tensors after a resharding load hold, rank by rank, the rows each rank saved (exact sums)."""
    for key, t in ps.tensors(state).items():
        offset = 0
        for sums in per_rank:
            rows, total = sums[key]
            part = t if rows is None else t[offset:offset + rows]
            if float(part.double().sum()) != total:
                raise SystemExit(f"{system}: the resharding load gives other values for {key}")
            if rows is None:
                break
            offset += rows


def worker_one(args: argparse.Namespace) -> None:
    join(args)  # a group of one: torch_checkpointing and DCP run as they would at world 1
    with open(os.path.join(args.dir, "ws2.json")) as f:
        expected = json.load(f)["expected"]
    peers = ps.Peers(args.tc_durable, device=args.device, tc_direct_io=args.tc_direct_io)
    model, opt = ps.build(args.size, None, device=args.device)
    states = {s: ps.state_of(s, model, opt) for s in ps.SYSTEMS}
    rounds = []
    for r in range(args.warmup + args.rounds):
        row = {}
        for s in rotated((*ps.SYSTEMS, "raw"), r):
            path = os.path.join(args.dir, f"{s}-main")
            files = sorted(os.path.join(path, n) for n in os.listdir(path)) if s == "raw" else []
            if s != "raw":
                zero(states[s])
            evict([path], 0)
            time.sleep(args.cold_sleep)
            row[f"load1/{s}"] = timed(lambda: targets.read_sequentially(files) if s == "raw"
                                      else peers.load(s, states[s], path))[0]
            if s != "raw":
                check_full(states[s], [e[s] for e in expected], s)
        rounds.append(row)
    with open(os.path.join(args.dir, "ws1.json"), "w") as f:
        json.dump(rounds, f)
    peers.close()
    dist.destroy_process_group()


# -- the driver and the report -------------------------------------------------------------------------------------


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


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[targets.Verdict]:
    verdicts = []
    print("\nconfiguration\n" + ps.CONFIGURATION)
    for size_text, res in results.items():
        first, rounds = res["rounds"][:args.warmup], res["rounds"][args.warmup:]
        world = res.get("world", 2)
        labels = dict(OPS)
        if world != 2:
            labels["load2"] = f"load, {world} rank{'s' if world > 1 else ''}, cold"
            labels["load1"] = f"load at 1 process (from {world} rank{'s' if world > 1 else ''}), cold"
        gb = res["rank_bytes"] * world / 1e9
        dim, ffn, layers = res["shape"]
        print(f"\n{size_text}: {gb * 1e3:.1f} MB of state (dim {dim}, ffn {ffn}, {layers} blocks, fp32 + AdamW), "
              f"{len(rounds)} rounds after {len(first)} warm-up, medians (s) of the slowest rank; page cache "
              f"dropped by {res['evicted_by']}, then {args.cold_sleep:g} s asleep")
        print(f"  {'op':36s} {'shardkit':>9s} {'DCP':>9s} {'torch_ckpt':>10s} {'raw':>9s} {'raw->t':>9s}   "
              f"{'vs best peer':>12s} {'vs raw':>7s} {'vs raw->t':>9s}  first call: shardkit / DCP / torch_ckpt")
        for op in [op for op, _ in OPS if op in args.ops]:
            label = labels[op]
            med = {s: statistics.median(r[f"{op}/{s}"] for r in rounds) for s in (*ps.SYSTEMS, "raw", "raw_into")
                   if f"{op}/{s}" in rounds[0]}
            best = min(("dcp", "torch_checkpointing"), key=lambda s: med[s])
            ratio = med["shardkit"] / med[best]
            raw = med["shardkit"] / med["raw"] if "raw" in med else None
            into = med["shardkit"] / med["raw_into"] if "raw_into" in med else None
            firsts = " / ".join(f"{r[f'{op}/{s}']:.3f}" for r in first[:1] for s in ps.SYSTEMS)
            print(f"  {label:36s} {med['shardkit']:9.3f} {med['dcp']:9.3f} {med['torch_checkpointing']:10.3f} "
                  f"{med.get('raw', float('nan')):9.3f} {med.get('raw_into', float('nan')):9.3f}   {ratio:11.2f}x "
                  f"{raw or float('nan'):6.2f}x {into or float('nan'):8.2f}x  {firsts}")
            verdicts.append(targets.Verdict(f"{size_text} {label}: shardkit / best peer ({ps.LABEL[best]})", ratio,
                                            PEER_LIMIT, f"{med['shardkit']:.3f} s / {med[best]:.3f} s"))
            if into is not None:  # the load's fair floor (the module docstring); the plain raw read is printed above
                verdicts.append(targets.Verdict(f"{size_text} {label}: shardkit / raw into tensors", into, RAW_LIMIT,
                                                f"{med['shardkit']:.3f} s / {med['raw_into']:.3f} s (raw read "
                                                f"{med['raw']:.3f} s: {raw:.2f}x)"))
            elif raw is not None and op in ("save", "load2") and res["rank_bytes"] * world >= RAW_FROM:
                verdicts.append(targets.Verdict(f"{size_text} {label}: shardkit / raw", raw, RAW_LIMIT,
                                                f"{med['shardkit']:.3f} s / {med['raw']:.3f} s"))
    return verdicts


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


def print_figures(verdicts: list[targets.Verdict], world: int) -> None:
    """Every verdict as a ``FIGURE`` line for ``benchmarks/gpu_check.sh``, and what one GPU cannot run."""
    for v in verdicts:
        print(f"FIGURE CUDA {v.name}: {v.value:.2f} (<= {v.limit:.2f}) {v.word}")
    if world < 2:
        print("FIGURE CUDA save, load and async save at 2 ranks, and the resharding load from 2 ranks: NOT VERIFIED: "
              "one GPU (NCCL takes one GPU per rank), so the sharded job ran at 1 rank")


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
