"""The report of ``benchmarks/peers.py`` (its docstring says what is measured and why): per size a table of the
median of every cell by system, and the verdicts -- shardkit against the best peer in every cell, and against
the raw floor from ``RAW_FROM`` on -- with, on CUDA, each verdict as a ``FIGURE`` line for
``benchmarks/gpu_check.sh``."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import checkpoint_targets as targets  # beside this file (peers.py puts benchmarks/ on sys.path)
import peers_systems as ps
from peers_jobs import OPS, RAW_FROM

RAW_LIMIT, PEER_LIMIT = 1.1, 1.0


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
            if into is not None:  # the load's fair floor (peers.py's docstring); the plain raw read is printed above
                verdicts.append(targets.Verdict(f"{size_text} {label}: shardkit / raw into tensors", into, RAW_LIMIT,
                                                f"{med['shardkit']:.3f} s / {med['raw_into']:.3f} s (raw read "
                                                f"{med['raw']:.3f} s: {raw:.2f}x)"))
            elif raw is not None and op in ("save", "load2") and res["rank_bytes"] * world >= RAW_FROM:
                verdicts.append(targets.Verdict(f"{size_text} {label}: shardkit / raw", raw, RAW_LIMIT,
                                                f"{med['shardkit']:.3f} s / {med['raw']:.3f} s"))
    return verdicts


def print_figures(verdicts: list[targets.Verdict], world: int) -> None:
    """Every verdict as a ``FIGURE`` line for ``benchmarks/gpu_check.sh``, and what one GPU cannot run."""
    for v in verdicts:
        print(f"FIGURE CUDA {v.name}: {v.value:.2f} (<= {v.limit:.2f}) {v.word}")
    if world < 2:
        print("FIGURE CUDA save, load and async save at 2 ranks, and the resharding load from 2 ranks: NOT VERIFIED: "
              "one GPU (NCCL takes one GPU per rank), so the sharded job ran at 1 rank")
