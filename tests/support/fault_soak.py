"""Save/load cycles at N gloo ranks with a fault drawn at random in some of them, and what the job did about it.

Each cycle is one fresh job of ``world_size`` ranks (:func:`tests.support.faulty_ranks.run_with_a_fault`):
every rank resumes the newest committed step of a ``CheckpointManager`` root (and checks the loaded weights
bitwise against what that step saved), sets the weights of the next step, and saves it.  In a faulted
cycle one rank, or the storage, fails on the way:

* ``kill`` / ``stop``: the rank SIGKILLs or SIGSTOPs itself, before its save or inside its first write;
* ``exception``: the rank's first write raises (a bug on one rank only);
* ``disk_full``: the rank's first write fails with ``ENOSPC``;
* ``slowdown`` / ``reset`` / ``cut``: the object store (moto behind :class:`~tests.support.fault_proxy.FaultProxy`)
  answers data PUTs with 503 SlowDown, a reset connection or an answer cut short -- once (retried, the save
  commits) or for good (the save fails on every rank once the retries are spent).

What is counted, per kind: how long the survivors took to raise (from the moment the fault struck: a dying
or freezing rank records it first), hangs (a survivor with no outcome by the driver's deadline, well past
the checkpoint deadline), committed steps lost (a step committed earlier that is no longer there) and
corrupt loads (a resumed step whose weights differ from what it saved).  ``benchmarks/faults.py`` runs
hundreds of cycles; the suite runs one of each kind.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.faulty_ranks import mark, marked, run_with_a_fault

LETHAL = ("kill", "stop")
ON_ONE_RANK = ("kill", "stop", "exception", "disk_full")
ON_STORAGE = ("slowdown", "reset", "cut")
KINDS = ON_ONE_RANK + ON_STORAGE
ROWS = 12  # rows of each weight: divisible by 1..4 ranks, so every rank writes a piece
S3_RETRIES = 2  # the soak's bound on retries: a fault that outlasts it fails the save


@dataclass(frozen=True)
class Cycle:
    """One save/load cycle: ``kind`` of fault (``None``: none), the rank it strikes, where (``moment``:
    before the save -- a rank that never calls it -- or in its first write), whether a storage fault is
    ``transient`` (the retries absorb it), and which root."""

    number: int
    kind: str | None
    target: int
    moment: str = "write"
    transient: bool = False

    @property
    def commits(self) -> bool:
        """Whether this cycle's save must commit."""
        return self.kind is None or (self.kind in ON_STORAGE and self.transient)

    @property
    def on_s3(self) -> bool:
        return self.kind in ON_STORAGE or (self.kind is None and self.number % 2 == 1)


def plan_cycles(cycles: int, world_size: int, fault_share: float, seed: int, *,
                every_kind_once: bool = False) -> list[Cycle]:
    """``cycles`` cycles with a fault in about ``fault_share`` of them, kinds and ranks drawn from ``seed``;
    ``every_kind_once``: the first cycles are one of each kind (storage faults outlasting the retries), then
    one storage fault the retries absorb, then clean ones, for a short soak."""
    rng = random.Random(seed)
    plan = []
    for n in range(cycles):
        if every_kind_once:
            kind = (KINDS + ("slowdown",))[n] if n <= len(KINDS) else None
            transient = n == len(KINDS)
        else:
            kind = rng.choice(KINDS) if rng.random() < fault_share else None
            transient = kind in ON_STORAGE and rng.random() < 0.5
        moment = rng.choice(("before", "write")) if kind in ("kill", "stop", "exception") else "write"
        plan.append(Cycle(n, kind, rng.randrange(world_size), moment, transient))
    return plan


def expected_weight(name: str, step: int, shape: tuple[int, ...]):
    """The full weight ``name`` holds once step ``step`` is saved: every step's values differ."""
    import torch

    gen = torch.Generator().manual_seed(hash((name, step)) % (2**31))
    return torch.randn(shape, generator=gen)


def _model():
    import torch.nn as nn

    import shardkit

    model = nn.Sequential(nn.Linear(8, ROWS), nn.Linear(ROWS, ROWS))
    for layer in model:
        shardkit.fully_shard(layer)
    shardkit.fully_shard(model)
    return model


def _local_rows(full, rank: int, world_size: int):
    return full.chunk(world_size, dim=0)[rank] if full.dim() else full


def _strike(cycle: Cycle, out_dir: str) -> None:
    """This rank's fault, now."""
    if cycle.kind in LETHAL:
        mark(out_dir, "fault")
        os.kill(os.getpid(), signal.SIGKILL if cycle.kind == "kill" else signal.SIGSTOP)
        time.sleep(3600)  # a stopped rank never gets here until the driver resumes and kills it
    mark(out_dir, "fault")
    if cycle.kind == "disk_full":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    raise RuntimeError(f"a fault injected on rank {cycle.target} (cycle {cycle.number})")


def soak_rank(cycle: Cycle, local_root: str, s3_root: str, s3_options: dict | None, timeout: float,
              out_dir: str) -> dict[str, Any]:
    """One cycle on this rank: resume, check, save the next step (see the module docstring)."""
    import torch
    import torch.distributed as dist

    import shardkit.checkpoint as skc
    from shardkit.checkpoint.io.storage import Storage

    rank, world = dist.get_rank(), dist.get_world_size()
    root, options = (s3_root, s3_options) if cycle.on_s3 else (local_root, None)
    model = _model()
    manager = skc.CheckpointManager(root, storage_options=options, timeout=timeout)
    resumed = manager.load_latest(model)
    step = resumed[0] if resumed else 0
    corrupt = []
    if resumed:
        for name, p in model.named_parameters():
            want = _local_rows(expected_weight(name, step, tuple(p.shape)), rank, world)
            if not torch.equal(p.to_local(), want):
                corrupt.append(name)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(_local_rows(expected_weight(name, step + 1, tuple(p.shape)), rank, world))
    striking = cycle.kind in ON_ONE_RANK and rank == cycle.target
    if striking and cycle.moment == "before":
        _strike(cycle, out_dir)
    if striking and cycle.kind == "disk_full":  # the disk refuses the first flush of a data file, as a full one does
        original_fsync = os.fsync

        def fsync(fd):
            os.fsync = original_fsync
            _strike(cycle, out_dir)
        os.fsync = fsync
    elif striking:
        original = Storage.write_stream

        def write_stream(self, name, *args, **kwargs):
            Storage.write_stream = original  # strike once
            _strike(cycle, out_dir)
        Storage.write_stream = write_stream
    manager.save(step + 1, model)
    manager.wait()
    return {"loaded": step, "saved": step + 1, "corrupt": corrupt}


@dataclass
class SoakReport:
    """What a soak saw (see the module docstring)."""

    cycles: int = 0
    faults: Counter = field(default_factory=Counter)
    seconds_to_error: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    hangs: list[str] = field(default_factory=list)
    lost_steps: list[str] = field(default_factory=list)
    corrupt_loads: list[str] = field(default_factory=list)
    wrong_outcomes: list[str] = field(default_factory=list)
    commits: int = 0

    def lines(self) -> list[str]:
        out = [f"cycles: {self.cycles}, faulted: {sum(self.faults.values())} "
               f"({100 * sum(self.faults.values()) / max(self.cycles, 1):.0f} %), steps committed: {self.commits}"]
        for kind in KINDS:
            times = self.seconds_to_error.get(kind, [])
            spread = (f"time to error min {min(times):.2f} s, median {statistics.median(times):.2f} s, "
                      f"max {max(times):.2f} s" if times else
                      "no error raised (every fault retried away)" if self.faults.get(kind) else "-")
            out.append(f"  {kind:<10} {self.faults.get(kind, 0):>4} faults; {spread}")
        out.append(f"hangs: {len(self.hangs)}")
        out.append(f"committed steps lost: {len(self.lost_steps)}")
        out.append(f"corrupt loads: {len(self.corrupt_loads)}")
        out.append(f"outcomes other than expected: {len(self.wrong_outcomes)}")
        for problem in self.hangs + self.lost_steps + self.corrupt_loads + self.wrong_outcomes:
            out.append(f"  {problem}")
        return out


def committed_steps(root: str, storage_options: dict | None) -> set[str]:
    """The step directories under ``root`` holding a manifest: what a resume may choose."""
    from shardkit.checkpoint.io.storage import Storage

    storage = Storage(root, storage_options)
    if not storage.exists():
        return set()
    return {name for name in storage.listdir() if name.startswith("step-") and storage.exists(f"{name}/manifest.json")}


def run_soak(plan: list[Cycle], world_size: int, timeout: float, *, local_root: str, s3_root: str,
             s3_options: dict | None, proxy: Any, grace: float = 5.0, progress: Any = None) -> SoakReport:
    """Run ``plan`` (see :func:`plan_cycles`); ``proxy`` is the :class:`FaultProxy` in front of ``s3_root``'s
    server (the storage faults are armed on it).  Every cycle's survivors must raise within ``timeout +
    grace`` of a lethal fault; a rank with no outcome ``timeout + 30`` s after the cycle began is a hang."""
    report = SoakReport()
    committed = {True: committed_steps(s3_root, s3_options), False: committed_steps(local_root, None)}
    for cycle in plan:
        report.cycles += 1
        if cycle.kind:
            report.faults[cycle.kind] += 1
        rule = None
        if cycle.kind in ON_STORAGE:
            rule = proxy.add(cycle.kind, method="PUT", path=r"/data/", times=1 if cycle.transient else None)
        out_dir = tempfile.mkdtemp(prefix=f"soak-{cycle.number}-")
        started = time.time()
        outcomes = run_with_a_fault(world_size, soak_rank, cycle, local_root, s3_root, s3_options, timeout, out_dir,
                                    out_dir=out_dir, timeout=timeout + 30.0,
                                    faulty=cycle.target if cycle.kind in LETHAL else None)
        first_fault = None
        if rule is not None:  # a storage fault strikes at the proxy's first faulted answer
            struck = min((r.at for r in proxy.faults()), default=None)  # the proxy's clock is monotonic
            first_fault = None if struck is None else time.time() - (time.monotonic() - struck)
            proxy.clear()
        _judge(cycle, outcomes, out_dir, started, first_fault, timeout, grace, report)
        now = committed_steps(s3_root if cycle.on_s3 else local_root, s3_options if cycle.on_s3 else None)
        gone = committed[cycle.on_s3] - now
        report.lost_steps += [f"cycle {cycle.number}: committed {name} is gone" for name in sorted(gone)]
        report.commits += len(now - committed[cycle.on_s3])
        committed[cycle.on_s3] = now
        if progress is not None:
            progress(cycle, outcomes)
    return report


def _judge(cycle: Cycle, outcomes: dict[int, dict | None], out_dir: str, started: float, first_fault: float | None,
           timeout: float, grace: float, report: SoakReport) -> None:
    expect_success = cycle.commits
    survivors = [r for r in outcomes if not (cycle.kind in LETHAL and r == cycle.target)]
    for rank in survivors:
        outcome = outcomes[rank]
        where = f"cycle {cycle.number} ({cycle.kind or 'no fault'}, rank {cycle.target}, {cycle.moment}) rank {rank}"
        if outcome is None:
            report.hangs.append(f"{where}: no outcome within {timeout + 30:.0f} s")
            continue
        if outcome["ok"]:
            report.corrupt_loads += [f"{where}: step {outcome['value']['loaded']} loaded {name} wrong"
                                     for name in outcome["value"]["corrupt"]]
            if not expect_success:
                report.wrong_outcomes.append(f"{where}: the save succeeded")
            continue
        if expect_success:
            report.wrong_outcomes.append(f"{where}: {outcome['type']}: {outcome['message'][:300]}")
            continue
        if not _named(cycle, rank, outcome):
            report.wrong_outcomes.append(f"{where}: raised {outcome['type']}: {outcome['message'][:300]}")
        fault_at = marked(out_dir, "fault") if Path(out_dir, "fault.time").exists() else (first_fault or started)
        took = outcome["at"] - fault_at
        report.seconds_to_error[cycle.kind].append(took)
        if cycle.kind in LETHAL and took > timeout + grace:
            report.wrong_outcomes.append(f"{where}: raised {took:.1f} s after the fault (deadline {timeout} s)")


def _named(cycle: Cycle, rank: int, outcome: dict) -> bool:
    """Whether ``outcome`` is the error the rule of trust promises for ``cycle``'s fault on ``rank``."""
    kinds = set(outcome["kinds"])
    if cycle.kind in LETHAL:
        return bool(kinds & {"CheckpointTimeout", "PeerLost"})
    if cycle.kind == "disk_full":
        return "OSError" in kinds and "CheckpointError" in kinds
    if cycle.kind in ON_STORAGE:
        return "StorageError" in kinds or "CheckpointError" in kinds
    return "ShardkitError" in kinds or rank == cycle.target  # the faulty rank raises its own error
