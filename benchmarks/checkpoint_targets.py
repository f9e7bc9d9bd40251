"""The save/load targets, and the definitions behind them, shared by the two benchmarks that judge them.

``benchmarks/checkpoint.py`` and ``benchmarks/save_load_minimal.py`` measure
independently (different harnesses, the same two libraries), but a verdict
only means something if both compute it the same way.  So this module holds,
once, what they must agree on:

* the targets and their limits (``TARGETS``);
* a ratio: the median of our times over the rounds divided by the median of
  the other's, every system timed in every round in a rotating order (the
  median of the per-round ratios is printed beside it, not judged);
* which shardkit loads are measured: ``"default"`` is ``load(sd, url)`` with
  no option, whatever mode that is, and the other mode is measured beside it
  and named for what it is (``"all-or-nothing"``: ``verify_first=True``, a
  checking pass and then the read; ``"one pass"``: ``verify_first=False``);
* "uncached": ``sync`` and ``drop_caches`` right before the timed call;
  "page-cached": every file of the checkpoint read once, untimed, right before;
* the disk's floor: each rank reads its share of the shardkit checkpoint's
  own data files (``data/*.safetensors``) once, front to back, with plain
  ``readinto`` calls into one reused buffer.  Same files, same blocks on
  disk, same number of ranks as the load it is compared with, and nothing
  done with the bytes: no loader that reads those files can be faster, so
  the load's ratio to it is what the loader adds to the disk.  (A rank's
  share: the files dealt out largest first to the rank with the fewest bytes
  so far, so each reads what its load reads when every rank loads the same
  amount, as a ``Shard(0)`` load at the saved world size does; one process
  reads them all.)
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable

DEFAULT = "default"
MIN_ROUNDS = 5  # a verdict from fewer rounds is a smoke run's, and the table says so


@dataclass(frozen=True)
class Target:
    key: str
    name: str
    limit: float


TARGETS = (
    Target("load/dcp", "default load, 2 ranks, uncached / DCP's", 1.0),
    Target("load/raw", "default load, 2 ranks, uncached / raw sequential read of its data files", 1.2),
    Target("save/dcp", "save, 2 ranks / DCP's", 0.6),
    Target("reshard/dcp", "default load at 1 process of the 2-rank checkpoint (reshard), uncached / DCP's", 0.8),
    Target("hsdp/bytes", "HSDP 2x2 default load: bytes asked of storage / the checkpoint's bytes", 1.05),
    Target("cached/dcp", "default load, 2 ranks, page-cached / DCP's", 1.0),
)


@dataclass(frozen=True)
class Verdict:
    """One line of the verdict table: ``value`` against ``limit``, or why it was not measured."""

    name: str
    value: float | None
    limit: float
    detail: str = ""
    not_measured: str = ""
    met_also_requires: bool = True  # e.g. every load filled the right values

    @property
    def word(self) -> str:
        if self.value is None:
            return "NOT MEASURED"
        return "MET" if self.value <= self.limit and self.met_also_requires else "MISSED"


def ratio(ours: list[float], theirs: list[float]) -> float:
    """The judged ratio: median of ours over the median of theirs, the same rounds."""
    return statistics.median(ours) / statistics.median(theirs)


def per_round_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median of the per-round ratios: printed beside ``ratio`` (it follows the disk's drift less)."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def judged(target_key: str, ours: list[float], theirs: list[float]) -> Verdict:
    """The verdict of a time ratio target from the per-round times of both systems."""
    target = next(t for t in TARGETS if t.key == target_key)
    detail = f"{statistics.median(ours):.3f} s / {statistics.median(theirs):.3f} s, per round " \
             f"{per_round_ratio(ours, theirs):.2f}x, {len(ours)} rounds"
    return Verdict(target.name, ratio(ours, theirs), target.limit, detail)


def not_measured(target_key: str, why: str) -> Verdict:
    target = next(t for t in TARGETS if t.key == target_key)
    return Verdict(target.name, None, target.limit, not_measured=why)


def load_modes(load: Callable[..., Any]) -> dict[str, dict[str, Any]]:
    """The two shardkit loads to time, by label -> keyword arguments: ``"default"`` (none) and the other mode."""
    if default_verifies_first(load):
        return {DEFAULT: {}, "one pass": {"verify_first": False}}
    return {DEFAULT: {}, "all-or-nothing": {"verify_first": True}}


def default_verifies_first(load: Callable[..., Any]) -> bool:
    return inspect.signature(load).parameters["verify_first"].default is True


def describe_modes(load: Callable[..., Any]) -> str:
    """One line saying which measured load is which mode (the default changes with the library's version)."""
    if default_verifies_first(load):
        return ("'default' = load(sd, url), which here is all or nothing (verify_first=True: a checking pass, "
                "then the read); 'one pass' = load(..., verify_first=False)")
    return ("'default' = load(sd, url), which here is one verified pass (verify_first=False); "
            "'all-or-nothing' = load(..., verify_first=True): a checking pass, then the read")


def drop_page_cache() -> bool:
    """Write back dirty pages, then drop the page cache; False where this process may not (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def read_every_file(path: str) -> None:
    """Read every file under ``path`` once (untimed), so the load that follows finds it page-cached."""
    read_sequentially([os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names])


def floor_files(checkpoint: str, rank: int, world: int) -> list[str]:
    """This rank's share of the shardkit checkpoint's data files for the disk's floor (module docstring)."""
    data = os.path.join(checkpoint, "data")
    files = sorted((os.path.getsize(os.path.join(data, n)), n) for n in os.listdir(data) if n.endswith(".safetensors"))
    if not files:
        raise SystemExit(f"no data files under {data}: the floor would read nothing")
    shares: list[list[str]] = [[] for _ in range(world)]
    loads = [0] * world
    for size, name in reversed(files):
        least = loads.index(min(loads))
        shares[least].append(os.path.join(data, name))
        loads[least] += size
    return sorted(shares[rank])


def read_sequentially(files: list[str], block: int = 8 << 20) -> int:
    """Read ``files`` one after the other, front to back, into one reused buffer; return the bytes read."""
    buf = memoryview(bytearray(block))
    total = 0
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while got := f.readinto(buf):
                total += got
    return total


def print_verdicts(verdicts: list[Verdict], rounds: int) -> None:
    """The final table, the same in both scripts: every target, its figure and MET / MISSED / NOT MEASURED."""
    print(f"\ntargets ({rounds} rounds; a ratio is our median over the rounds / the other's median, every system "
          f"timed in every round)")
    if rounds < MIN_ROUNDS:
        print(f"  ONLY {rounds} ROUNDS: a smoke run; a verdict counts from {MIN_ROUNDS} rounds on")
    width = max(len(v.name) for v in verdicts)
    for v in verdicts:
        if v.value is None:
            print(f"  {v.name:{width}s}  {'-':>6s} (<= {v.limit:.2f})  NOT MEASURED: {v.not_measured}")
        else:
            print(f"  {v.name:{width}s}  {v.value:5.2f}x (<= {v.limit:.2f})  {v.word:6s}  {v.detail}")


def judge_sizes(sizes: str, measure: Callable[[str], dict[str, Any]],
                report: Callable[[str, dict[str, Any]], list[Verdict]], rounds: int, json_path: str | None) -> None:
    """Measure each of the comma-separated ``sizes`` and judge it, keep the raw results at ``json_path`` when
    given, then print the final table: the loop every benchmark that runs at several sizes shares."""
    verdicts: list[Verdict] = []
    results: dict[str, dict[str, Any]] = {}
    for size in sizes.split(","):
        results[size] = measure(size)
        verdicts += report(size, results[size])
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f)
    print_verdicts(verdicts, rounds)
