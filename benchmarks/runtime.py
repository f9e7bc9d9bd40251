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
IMPLS = ("shardkit", "torch")
DEBUG = "shardkit+debug"  # shardkit with debug mode on, timed in phase 1 only


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


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _HeapPeak:
    """Peak of malloc's bytes in use since the last ``reset()``, from a sampling thread."""

    def __init__(self) -> None:
        self.read = _heap_reader()
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.read:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(0.0005)

    def reset(self) -> None:
        if self.read:
            self.start = self.peak = self.read()

    def above_start_mib(self) -> float:
        return (max(self.peak, self.read()) - self.start) / 2**20 if self.read else float("nan")

    def stop(self) -> None:
        self._stop.set()


class _DevicePeak:
    """The CUDA side of :class:`_HeapPeak`: peak of the device memory allocated since the last ``reset()``."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda
        self.start = 0

    def read(self) -> int:
        return self.cuda.memory_allocated()

    @property
    def peak(self) -> int:
        return self.cuda.max_memory_allocated()

    def reset(self) -> None:
        self.cuda.synchronize()
        self.cuda.reset_peak_memory_stats()
        self.start = self.read()

    def above_start_mib(self) -> float:
        self.cuda.synchronize()
        return (self.peak - self.start) / 2**20

    def stop(self) -> None:
        pass


def _init(args: argparse.Namespace):
    """Join the job's process group (NCCL and this rank's GPU with ``--device cuda``); the memory meter."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        return _DevicePeak()
    dist.init_process_group("gloo")
    return _HeapPeak()


def _sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        import torch

        torch.cuda.synchronize()


def _build(impl: str, args: argparse.Namespace):
    """The model of one implementation (``DEBUG`` builds shardkit's) and its optimizer:
    per-block fully_shard plus the root, after tensor parallelism when ``--tp`` > 1."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(REPO))
    from tests.support.models import ModelArgs, Transformer, parallelize_blocks

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from shardkit import fully_shard
    margs = ModelArgs(vocab_size=args.vocab, dim=args.dim, n_heads=args.heads, n_layers=args.layers,
                      ffn_dim=args.ffn, max_seq_len=args.seq)
    torch.manual_seed(0)
    model = Transformer(margs).to(args.device)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),)) if args.device == "cuda" else None
    if args.tp > 1:
        world = init_device_mesh(args.device, (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize_blocks(model, world["tp"])
        mesh = world["dp"]
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _data_parallel_rank(args: argparse.Namespace) -> int:
    """Tensor-parallel peers train on the same batch."""
    import torch.distributed as dist

    return dist.get_rank() // args.tp


def _train_step(model, opt, tokens, args: argparse.Namespace, debug: bool = False) -> None:
    import torch
    import torch.nn.functional as F

    import shardkit

    if debug:
        shardkit.set_debug(True)
    try:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
    finally:
        if debug:
            shardkit.set_debug(False)
    clip = shardkit.clip_grad_norm_ if args.tp > 1 else torch.nn.utils.clip_grad_norm_
    clip(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def _emit(result) -> None:
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.barrier()  # no rank tears gloo down while a peer still sends
    dist.destroy_process_group()
    # torch 2.13 + gloo occasionally aborts in interpreter teardown ("terminate called
    # without an active exception"), with either implementation; the results are out
    sys.stdout.flush()
    os._exit(0)


def worker_interleaved(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    heap = _init(args)
    rank = dist.get_rank()
    timed = (*IMPLS, DEBUG)
    models = {impl: _build(impl, args) for impl in timed}
    gen = torch.Generator().manual_seed(1 + _data_parallel_rank(args))
    wall = {impl: [] for impl in timed}
    cpu = {impl: [] for impl in timed}
    peak = {impl: [] for impl in timed}
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
        order = timed[step % len(timed):] + timed[:step % len(timed)]  # each goes first in turn
        for impl in order:
            dist.barrier()
            heap.reset()
            start, cpu_start = time.perf_counter(), time.process_time()
            _train_step(*models[impl], tokens, args, debug=impl == DEBUG)
            _sync(args)
            wall[impl].append((time.perf_counter() - start) * 1e3)
            cpu[impl].append((time.process_time() - cpu_start) * 1e3)
            peak[impl].append(heap.above_start_mib())
    heap.stop()
    result = {"rank": rank, "params": sum(p.numel() for p in models["shardkit"][0].parameters())}
    for impl in timed:
        walls = torch.tensor(wall[impl], device=args.device)
        dist.all_reduce(walls, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        result[impl] = {"wall": walls.tolist()[args.warmup:], "cpu": cpu[impl][args.warmup:],
                        "heap": peak[impl][args.warmup:]}
    _emit(result)


def worker_memory(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    heap = _init(args)
    heap.reset()
    model, opt = _build(args.impl, args)
    gen = torch.Generator().manual_seed(1 + _data_parallel_rank(args))
    first_ms = 0.0
    for step in range(args.warmup + args.memory_steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
        dist.barrier()
        start = time.perf_counter()
        _train_step(model, opt, tokens, args)
        _sync(args)
        if step == 0:  # cold: lazy init, first allocations, first dispatch of every op
            first_ms = (time.perf_counter() - start) * 1e3
    heap.stop()
    in_use = max(heap.peak, heap.read()) / 2**20 if heap.read else float("nan")
    _emit({"rank": dist.get_rank(), "hwm_mib": _hwm_mib(), "first_ms": first_ms, "heap_peak_mib": in_use})


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

    med = statistics.median
    rows = []

    def row(label: str, ours: float, theirs: float, fmt: str = "{:.1f}") -> None:
        rows.append((label, fmt.format(ours), fmt.format(theirs), f"{ours / theirs:.3f}"))

    ranks = range(args.ranks)
    memory_kind = "CUDA" if args.device == "cuda" else "heap"
    row("ms/step, wall (median)", med(timing[0]["shardkit"]["wall"]), med(timing[0]["torch"]["wall"]))
    for k in ranks:
        row(f"ms/step, CPU, rank {k}", med(timing[k]["shardkit"]["cpu"]), med(timing[k]["torch"]["cpu"]))
    for k in ranks:
        row(f"step {memory_kind} peak MiB, rank {k}", med(timing[k]["shardkit"]["heap"]),
            med(timing[k]["torch"]["heap"]), "{:.2f}")
    if args.rounds:
        _memory_rows(row, memory, ranks)
    _print_table(args, timing, rows)
    if args.rounds:
        spread = {impl: statistics.stdev(v) if len(v) > 1 else 0.0 for impl, v in _hwm(memory, ranks).items()}
        print(f"\npeak RSS standard deviation between jobs: shardkit {spread['shardkit']:.1f} MiB, "
              f"torch {spread['torch']:.1f} MiB")
    debug_wall, plain_wall = med(timing[0][DEBUG]["wall"]), med(timing[0]["shardkit"]["wall"])
    debug_cpu = med(med(timing[k][DEBUG]["cpu"]) / med(timing[k]["shardkit"]["cpu"]) for k in ranks)
    print(f"debug mode (SHARDKIT_DEBUG=1): {debug_wall:.1f} ms/step vs {plain_wall:.1f} without, wall ratio "
          f"{debug_wall / plain_wall:.3f} (target <= 1.10); CPU ratio, median over ranks, {debug_cpu:.3f}")
    # one line per target, for scripts (benchmarks/gpu_check.sh collects them into its report)
    job = f"{args.device} world {args.ranks}"
    wall_ratio = med(timing[0]["shardkit"]["wall"]) / med(timing[0]["torch"]["wall"])
    memory_ratio = max(med(timing[k]["shardkit"]["heap"]) / max(med(timing[k]["torch"]["heap"]), 1e-9) for k in ranks)
    for name, value, limit in ((f"{job}: ms/step shardkit / torch fully_shard", wall_ratio, 1.0),
                               (f"{job}: step {memory_kind} peak shardkit / torch, worst rank", memory_ratio, 1.0),
                               (f"{job}: debug mode / plain, wall", debug_wall / plain_wall, 1.10)):
        print(f"FIGURE {name}: {value:.3f} (<= {limit:.2f}) {'MET' if value <= limit else 'MISSED'}")


def _hwm(memory: dict, ranks: range) -> dict[str, list[float]]:
    # peak RSS swings by +-20 MiB between identical jobs on this VM: pool all ranks of every round
    return {impl: [r[k]["hwm_mib"] for r in memory[impl] for k in ranks] for impl in IMPLS}


def _memory_rows(row, memory: dict, ranks: range) -> None:
    """Phase 2's rows: cold first step, peak RSS and malloc's peak in use, over the fresh jobs."""
    med = statistics.median
    row("first step ms (fresh job)", med(max(r[k]["first_ms"] for k in ranks) for r in memory["shardkit"]),
        med(max(r[k]["first_ms"] for k in ranks) for r in memory["torch"]))
    hwm = _hwm(memory, ranks)
    row(f"peak RSS MiB, mean of {len(hwm['torch'])}", statistics.mean(hwm["shardkit"]), statistics.mean(hwm["torch"]))
    row("peak RSS MiB, median", med(hwm["shardkit"]), med(hwm["torch"]))
    in_use = {impl: [r[k]["heap_peak_mib"] for r in memory[impl] for k in ranks] for impl in IMPLS}
    row("peak malloc in use MiB, median", med(in_use["shardkit"]), med(in_use["torch"]), "{:.2f}")


def _print_table(args: argparse.Namespace, timing: list[dict], rows: list[tuple]) -> None:
    layout = (f"TP {args.tp} in every block x FSDP over dp 2, " if args.tp > 1 else "") + \
        "per-block fully_shard + root"
    ranks = "NCCL ranks, one GPU each" if args.device == "cuda" else "gloo ranks x 1 thread"
    print(f"\nTransformer {timing[0]['params'] / 1e6:.1f}M params (dim {args.dim}, {args.layers} layers, vocab "
          f"{args.vocab}), {args.ranks} {ranks}, batch {args.batch}x{args.seq} per dp rank, AdamW + "
          f"clip_grad_norm_, {layout}.\nPhase 1: {args.steps} timed steps each after "
          f"{args.warmup} warm-up, interleaved in one job.  Phase 2: {args.rounds} fresh jobs each, "
          f"{args.warmup + args.memory_steps} steps.\n")
    widths = (28, 12, 12, 8)
    print("".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in
                  enumerate(zip(("", "shardkit", "torch", "ratio"), widths))))
    print("-" * sum(widths))
    for r in rows:
        print("".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


if __name__ == "__main__":
    main()
