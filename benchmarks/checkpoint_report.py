"""The save/load/async tables of ``benchmarks/checkpoint.py``, from the figures its repetitions kept, and the
verdicts of the targets they measure (defined in :mod:`checkpoint_targets`, shared with ``save_load_minimal.py``)."""

from __future__ import annotations

import argparse
import json
import os
import statistics

import checkpoint_targets as targets  # beside this file (the benchmarks put benchmarks/ on sys.path)
from checkpoint_jobs import MODES

import shardkit.checkpoint as skc


def report(args: argparse.Namespace,
           results: str) -> tuple[dict[str, targets.Verdict], list[targets.Verdict]]:
    """Print the save/load/async tables from the results kept in ``results``; return the verdicts of the shared
    targets this phase measures (by key) and of this script's own (async_save)."""
    runs: dict[str, list[dict]] = {}
    state_gb, cold_sleep = None, args.cold_sleep
    for rep in range(args.rounds):
        for ws in ("ws2", "ws1"):
            with open(os.path.join(results, f"shardkit-ckpt-bench-{ws}-{rep}.json")) as f:
                data = json.load(f)
            state_gb = data.pop("state_gb_total", state_gb)
            data.pop("rank_bytes", None)
            cold_sleep = data.pop("cold_sleep_s", cold_sleep)  # the 2-rank jobs record it
            for key, value in data.items():
                runs.setdefault(key, []).append(value)

    def med(key: str, field: str = "s") -> float:
        return statistics.median(r[field] for r in runs[key])

    def times(key: str) -> list[float]:
        return [r["s"] for r in runs[key]]  # in repetition order, so the systems' rounds line up

    def spread(key: str) -> str:
        values = sorted(times(key))
        return f"{values[0]:.2f}-{values[-1]:.2f}"

    dropped = all(r.get("dropped", True) for key in runs if key.endswith("/uncached") for r in runs[key])
    print(f"\nstate: {state_gb:.2f} GB (weights + AdamW), 2 gloo ranks; {args.rounds} repetitions, medians (min-max); "
          f"uncached: page cache dropped before every load: {dropped}, then {cold_sleep:g} s asleep")
    print(targets.describe_modes(skc.load))
    print("raw: saves write each rank's shards to one file; loads read each rank's share of shardkit's own data "
          "files front to back (the disk's floor, benchmarks/checkpoint_targets.py)")
    print(f"{'op':32s} {'shardkit s':>17s} {'GB/s':>5s} {'RSS+':>6s} {'DCP s':>6s} {'raw s':>6s} "
          f"{'vs DCP':>6s} {'vs raw':>6s}")
    saves = [("save, 2 ranks, cold", "save", "cold"), ("save, 2 ranks, warm", "save", "warm")]
    loads = [("load, 2 ranks, page-cached", "load2", "page-cached"), ("load, 2 ranks, uncached", "load2", "uncached"),
             ("load at 1 (reshard), page-cached", "load1", "page-cached"),
             ("load at 1 (reshard), uncached", "load1", "uncached")]
    sections = [("shardkit", "save(): data files with O_DIRECT", saves),
                ("shardkit-buffered", "save(direct_io=False): buffered writes", saves)] + \
        [(label, f"shardkit load, {label}", loads) for label in MODES]
    for name, what, ops in sections:
        print(f"-- {what}")
        for label, op, variant in ops:
            ours, theirs, raw = f"{op}/{name}/{variant}", f"{op}/dcp/{variant}", f"{op}/raw/{variant}"
            print(f"{label:32s} {med(ours):5.2f} ({spread(ours):>10s}) {state_gb / med(ours):5.2f} "
                  f"{100 * med(ours, 'rss'):5.1f}% {med(theirs):6.2f} {med(raw):6.2f} "
                  f"{med(ours) / med(theirs):5.2f}x {med(ours) / med(raw):5.2f}x")
    print("\nasync_save blocking time (s), 2 ranks; background = from return until committed")
    for system in ("shardkit", "dcp"):
        for attempt in ("first", "repeat"):
            key = f"async/{system}/{attempt}"
            print(f"  {system:9s} {attempt:7s} blocking {med(key):6.3f}  RSS+ {100 * med(key, 'rss'):5.1f}%  "
                  f"background {statistics.median(r['background_s'] for r in runs[key]):6.2f}")
    clone, pre = "async/copy-to-host/clone", "async/copy-to-host/preallocated"
    print(f"  copy of the local shards to host memory: fresh clone {med(clone):.3f} s, "
          f"into preallocated buffers {med(pre):.3f} s")
    print(f"  shardkit repeat / fresh clone = {med('async/shardkit/repeat') / med(clone):.2f}x, "
          f"/ preallocated copy = {med('async/shardkit/repeat') / med(pre):.2f}x")

    def uncached(key: str, ours: str, theirs: str) -> targets.Verdict:
        if not dropped:
            return targets.not_measured(key, "the page cache could not be dropped here (drop_caches needs root)")
        return targets.judged(key, times(ours), times(theirs))

    found = {
        "load/dcp": uncached("load/dcp", "load2/default/uncached", "load2/dcp/uncached"),
        "load/raw": uncached("load/raw", "load2/default/uncached", "load2/raw/uncached"),
        "save/dcp": targets.judged("save/dcp", times("save/shardkit/warm"), times("save/dcp/warm")),
        "reshard/dcp": uncached("reshard/dcp", "load1/default/uncached", "load1/dcp/uncached"),
        "cached/dcp": targets.judged("cached/dcp", times("load2/default/page-cached"), times("load2/dcp/page-cached")),
    }
    ratio = med("async/shardkit/repeat") / med(pre)
    return found, [targets.Verdict("async_save blocking (repeat) / copy into preallocated host buffers", ratio, 1.2)]

