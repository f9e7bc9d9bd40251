"""The report of ``benchmarks/runtime.py`` (its docstring says what is measured and why): the table of shardkit
against torch -- phase 1's step time, CPU time and step memory per rank, phase 2's cold first step, peak RSS and
malloc's peak in use -- debug mode's cost, and one ``FIGURE`` line per target for scripts
(``benchmarks/gpu_check.sh`` collects them)."""

from __future__ import annotations

import argparse
import statistics

from runtime_job import DEBUG, IMPLS  # beside this file (the script's folder is on sys.path)


def report(args: argparse.Namespace, timing: list[dict], memory: dict[str, list[list[dict]]]) -> None:
    """Print the table and the targets from phase 1's ``timing`` (per rank) and phase 2's ``memory`` (per
    implementation, per fresh job, per rank)."""
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
