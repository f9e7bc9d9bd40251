"""Crash safety of the hot tier: 4 ranks as 2 nodes of 2, every step saved, SIGKILLed at random moments.

Each round forks 4 fresh ranks from this process (torch and shardkit imported once, here), as torchrun
restarts every worker after a failure.  They resume with ``load_latest``, check that what they loaded is
exactly the state the run had at that step, and save every step -- to the hot tier with one replica on
the other node, to the durable root every 5th step -- alternating blocking saves and background ones.
After each step a rank's save acknowledged (``save`` returned, or the future of a background save
completed) it appends the step to its report, flushed and fsynced.  The test then SIGKILLs the ranks:
all four at once, or one node first, its survivors failing their next collective within the short
process-group timeout, and the others after.  A round kills at a random point of a save cycle (drawn
from the cycle's length between the round's first two acknowledged steps), or 0-20 ms after it sees a
replica's bytes landing in the transfer's staging directory, or a rank's own copy being written
(:data:`ROUNDS`, :func:`_kill_when`; the delays come from ``random.Random(SEED)``).

The state is a function of the step and the rank (:func:`_fill`), so a resume is checked without a
reference run.  A step is acknowledged once *any* rank acknowledged it (the ranks agree on completion
before any ``save`` returns), so the next round must resume at or above the newest step any rank
reported.  The last restart wipes one node's directory first and must resume from the replicas on the
other node.  Where each kill landed is read from the directories it left (:func:`_where_it_landed`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import shutil
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch._dynamo  # noqa: F401 - imported once here, inherited by every forked rank
import torch.distributed as dist
import torch.nn as nn

import shardkit.checkpoint as skc
from shardkit import fully_shard
from shardkit.checkpoint.training.hot.nodes import COMPLETE_NAME

pytestmark = pytest.mark.slow

log = logging.getLogger("shardkit.tests.hot_kill")  # in each rank's log, beside the library's lines

WORLD, PER_NODE, DURABLE_EVERY, LOCAL_KEEP = 4, 2, 5, 2
PG_TIMEOUT_S = 10.0     # survivors of a node's loss fail their next collective within this (gloo sees a
                        # killed peer's closed connection at once; the timeout is for a loaded machine)
ROUND_START_S = 90.0    # for a round's ranks to resume and acknowledge a step on a loaded machine
SURVIVORS_EXIT_S = PG_TIMEOUT_S + 4.0
STEPS_AFTER_LAST_RESUME = 3
SEED = 7
# one round per kill: (background saves?, when to kill, whose ranks first: None for all four at once)
ROUNDS = [(False, "anytime", None), (True, "replication", None), (False, "replication", [0, 1]),
          (True, "anytime", [2, 3]), (False, "own copy", None), (True, "replication", None)]


class _Wide(nn.Module):
    """About 8 MB of parameters (2 MB a rank once sharded over 4), one with rows that do not split evenly."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(1024, 1024))
        self.b = nn.Parameter(torch.zeros(1024, 1024))
        self.c = nn.Parameter(torch.zeros(517, 33))


def _pattern(shape: torch.Size, step: int, rank: int, index: int) -> torch.Tensor:
    """Rank ``rank``'s shard of parameter ``index`` at ``step``: every rank's shards differ, so a shard
    loaded on the wrong rank, or from another step, shows."""
    return torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) + 1000.0 * step + 100.0 * rank + index


def _fill(model: nn.Module, step: int) -> None:
    """The state of the run at ``step``."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.to_local().copy_(_pattern(p.to_local().shape, step, dist.get_rank(), i))


def _is_step(model: nn.Module, step: int) -> bool:
    return all(torch.equal(p.to_local(), _pattern(p.to_local().shape, step, dist.get_rank(), i))
               for i, p in enumerate(model.parameters()))


def _sharded() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    model = _Wide()
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    return model


def _manager(root: str, async_save: bool) -> skc.CheckpointManager:
    return skc.CheckpointManager(os.path.join(root, "durable"), local=os.path.join(root, "hot", "node{node}"),
                                 local_world_size=PER_NODE, replicas=1, local_keep=LOCAL_KEEP,
                                 durable_every=DURABLE_EVERY, async_save=async_save)


def _report(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(3)  # the test is gone: never save forever


def _rank(rank: int, root: str, store: str, report: str, async_save: bool, steps: int | None) -> None:
    """One rank of one restart: resume, check what it loaded, then save every step -- until killed, or
    ``steps`` steps and a clean exit."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    err = os.open(f"{report}.err", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(err, 1)
    os.dup2(err, 2)
    logging.basicConfig(filename=f"{report}.log", level=logging.INFO, force=True,
                        format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    model = _sharded()
    manager = _manager(root, async_save)
    log.info("resuming")
    resumed = manager.load_latest(model)
    if resumed is None:
        start = 0
        _report(report, "resumed -1 none ok")
    else:
        start, extra = resumed
        intact = _is_step(model, start)
        _report(report, f"resumed {start} {manager.last_load.source} "
                        f"{'ok' if intact and extra == {'step': start} else 'DAMAGED'}")
    step = start + 1
    while steps is None or step <= start + steps:
        log.info("saving step %d", step)
        _fill(model, step)
        future = manager.save(step, model, extra={"step": step})
        if future is not None:
            _fill(model, -1)  # training goes on while the save runs in the background
            future.result()
        _report(report, f"ack {step} {time.monotonic()}")
        step += 1
    manager.wait()
    dist.destroy_process_group()
    os._exit(0)


def _lines(report: str) -> list[list[str]]:
    try:
        with open(report) as f:
            return [line.split() for line in f.read().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


class _Restart:
    """The job restarted: four ranks forked from this process, and what they reported."""

    def __init__(self, root: str, number: int, *, async_save: bool, steps: int | None = None) -> None:
        self.root = root
        self.reports = [os.path.join(root, "reports", f"restart{number}-rank{r}") for r in range(WORLD)]
        store = os.path.join(root, "stores", f"restart{number}")
        ctx = multiprocessing.get_context("fork")
        self.procs = [ctx.Process(target=_rank, args=(r, root, store, self.reports[r], async_save, steps))
                      for r in range(WORLD)]
        for proc in self.procs:
            proc.start()

    def resumed(self) -> list[tuple[int, str, str]]:
        """Each rank's (step, source, "ok" | "DAMAGED") as it reported its resume."""
        found = [[line for line in _lines(r) if line[0] == "resumed"] for r in self.reports]
        return [(int(f[0][1]), f[0][2], f[0][3]) for f in found if f]

    def acks(self) -> dict[int, float]:
        """Each step any rank's save acknowledged, with when the first rank did."""
        acks: dict[int, float] = {}
        for report in self.reports:
            for line in _lines(report):
                if line[0] == "ack":
                    acks[int(line[1])] = min(float(line[2]), acks.get(int(line[1]), float("inf")))
        return acks

    def acknowledged(self) -> int:
        """The newest step any rank's save acknowledged in this restart (-1: none)."""
        return max(self.acks(), default=-1)

    def wait_until(self, done, what: str) -> None:
        deadline = time.monotonic() + ROUND_START_S
        while not done():
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            assert not dead, f"ranks {dead} ended ({[self.procs[r].exitcode for r in dead]}) while waiting for " \
                             f"{what}:\n{self.logs()}"
            assert time.monotonic() < deadline, f"no {what} within {ROUND_START_S} s:\n{self.logs()}"
            time.sleep(0.002)

    def kill(self, ranks: list[int]) -> None:
        for r in ranks:
            os.kill(self.procs[r].pid, signal.SIGKILL)

    def join(self, ranks: list[int], timeout: float) -> list[int]:
        """Wait for ``ranks`` to end (at most ``timeout`` in all); those still alive."""
        deadline = time.monotonic() + timeout
        for r in ranks:
            self.procs[r].join(max(0.0, deadline - time.monotonic()))
        return [r for r in ranks if self.procs[r].is_alive()]

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)

    def logs(self) -> str:
        out = []
        for r, report in enumerate(self.reports):
            for suffix in (".log", ".err"):
                if os.path.exists(report + suffix):
                    with open(report + suffix) as f:
                        out.append(f"--- rank {r} {suffix} ---\n" + "".join(f.readlines()[-15:]))
        return "\n".join(out)


def _step_dirs(root: str) -> dict[int, dict[int, str]]:
    """``{step: {node: its step directory}}`` of the hot tier."""
    found: dict[int, dict[int, str]] = {}
    for node in range(WORLD // PER_NODE):
        node_dir = os.path.join(root, "hot", f"node{node}")
        for run in _listing(node_dir):  # the run's directory, run-<digest of the durable root>
            for name in _listing(os.path.join(node_dir, run)):
                if name.startswith("step-"):
                    found.setdefault(int(name[5:]), {})[node] = os.path.join(node_dir, run, name)
    return found


def _replicating(root: str, above: int) -> bool:
    """Whether bytes of a replica of a step above ``above`` are landing (in the transfer's staging directory)."""
    return any(name.startswith(".replica-") and ".partial-" in name and _listing(os.path.join(path, name))
               for step, nodes in _step_dirs(root).items() if step > above
               for path in nodes.values() for name in _listing(path))


def _writing_own_copies(root: str, above: int) -> bool:
    """Whether a rank is writing its own copy of a step above ``above`` (no manifest yet)."""
    return any(name.startswith("rank-") and not os.path.exists(os.path.join(path, name, "manifest.json"))
               for step, nodes in _step_dirs(root).items() if step > above
               for path in nodes.values() for name in _listing(path))


def _listing(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:  # removed by retention meanwhile
        return []


def _where_it_landed(root: str) -> str:
    """What a kill interrupted, read from what it left in the nodes' directories: how far the newest step's
    save had come (own copies and replicas written, replicas arriving, completion markers), and whether
    retention or the durable save after it were still to run."""
    steps = _step_dirs(root)
    if not steps:
        return "before the first save"
    newest = max(steps)
    listed = {path: _listing(path) for path in steps[newest].values()}
    written = {kind: sum(name.startswith(f"{kind}-") and os.path.exists(os.path.join(path, name, "manifest.json"))
                         for path, names in listed.items() for name in names) for kind in ("rank", "replica")}
    arriving = sum(name.startswith(".replica-") for names in listed.values() for name in names)
    markers = sum(COMPLETE_NAME in names for names in listed.values())
    where = (f"step {newest}: {written['rank']}/{WORLD} own copies, {written['replica']}/{WORLD} replicas "
             f"({arriving} arriving), {markers}/{WORLD // PER_NODE} markers")
    if markers == WORLD // PER_NODE and len(steps) > LOCAL_KEEP:
        where += ", retention to run"
    durable = os.path.join(root, "durable", f"step-{newest:010d}")
    if newest % DURABLE_EVERY == 0 and not os.path.exists(os.path.join(durable, "manifest.json")):
        where += ", durable save to run" if not os.path.isdir(durable) else ", durable save under way"
    return where


def _kill_when(job: _Restart, when: str, rng: random.Random) -> None:
    """Wait for the moment ``when`` of a save after this restart's first acknowledged step, then return."""
    job.wait_until(lambda: job.acknowledged() >= 0, "acknowledged step")
    first = job.acknowledged()
    if when == "anytime":  # a random point of the next save cycle, measured on this machine now
        job.wait_until(lambda: job.acknowledged() > first, "second acknowledged step")
        acks = job.acks()
        time.sleep(rng.uniform(0.0, acks[first + 1] - acks[first]))
        return
    happening = _replicating if when == "replication" else _writing_own_copies
    job.wait_until(lambda: happening(job.root, first), when)
    time.sleep(rng.uniform(0.0, 0.02))


def test_sigkill_at_random_moments_of_hot_saves_never_resumes_before_the_newest_acknowledged_step(tmp_path):
    # 6 kills; on a 2-core machine they landed: after step 2 completed; in step 4's replication (all 4 replicas
    # arriving); in step 6's replication with node 0 lost first; after step 8 completed with node 1 lost first;
    # in step 10's own copies (a durable step); in step 11's replication.  The restarts resumed from the local
    # tier at 2, 4, 6, 8 and 9, and the last, with node 1 wiped, from the peer replicas at 10.
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "reports"))
    os.makedirs(os.path.join(root, "stores"))
    rng = random.Random(SEED)
    acknowledged, landed, resumed_at = -1, [], []
    for number, (async_save, when, first_lost) in enumerate(ROUNDS):
        job = _Restart(root, number, async_save=async_save)
        try:
            _kill_when(job, when, rng)
            if first_lost is None:
                job.kill(list(range(WORLD)))
            else:  # one node lost: the survivors fail their next collective, or are killed after a while
                job.kill(first_lost)
                stuck = job.join([r for r in range(WORLD) if r not in first_lost], SURVIVORS_EXIT_S)
                job.kill(stuck)
        finally:
            job.kill_all()
        resumed = job.resumed()
        assert len(resumed) == WORLD and all(ok == "ok" for _, _, ok in resumed), (resumed, landed)
        assert len({step for step, _, _ in resumed}) == 1 and resumed[0][0] >= acknowledged, \
            (resumed, acknowledged, landed)
        resumed_at.append(resumed[0][:2])
        acknowledged = max(acknowledged, job.acknowledged())
        landed.append(_where_it_landed(root) + ("" if first_lost is None else
                                                f"; node {first_lost[0] // PER_NODE} first, its survivors "
                                                f"{'killed' if stuck else 'failed on their own'}"))
    shutil.rmtree(os.path.join(root, "hot", "node1"))  # the last kill took node 1's disk with it
    job = _Restart(root, len(ROUNDS), async_save=False, steps=STEPS_AFTER_LAST_RESUME)
    try:
        assert job.join(list(range(WORLD)), ROUND_START_S) == [], job.logs()
    finally:
        job.kill_all()
    print(f"seed {SEED}: kills landed in {landed}; resumed at {resumed_at}; last resume {job.resumed()}")
    assert [proc.exitcode for proc in job.procs] == [0] * WORLD, job.logs()
    resumed = job.resumed()
    assert len(resumed) == WORLD and all(ok == "ok" for _, _, ok in resumed), resumed
    assert {(step, source) for step, source, _ in resumed} == {(resumed[0][0], "peer")}
    assert resumed[0][0] >= acknowledged
    assert job.acknowledged() == resumed[0][0] + STEPS_AFTER_LAST_RESUME
