"""The hot tier: what a save every step costs the training loop, and how fast a job recovers from each tier.

One 4-rank job (``torchrun``, gloo on CPU) plays 2 nodes of 2 (``local_world_size=2``): a stack of
``--layers`` square linear layers of width ``--dim`` (shardkit ``fully_shard`` per layer and at the root)
with AdamW's state, about ``--gb`` GB in all (weights + two moments).  The hot tier lives under
``/dev/shm`` (a directory per node), the durable roots and DCP's checkpoint on local disk under a
temporary directory.  ``--rounds`` rounds run the arms of each measurement interleaved (their order
rotates from round to round); every figure is a median over the rounds of the slowest rank.

1. **Blocking time per hot save** (``async_save=True``, a step that is not durable): the wall time of
   ``manager.save`` on the training thread (state dict, RNG, the copy into the reused host buffers, the
   hand-off to the background thread), beside a plain copy of the same local tensors into buffers
   allocated once before the rounds.  Target: <= 1.2x the copy.  The blocking time of a hot save that is
   also durable and of the durable manager's own async save are shown beside it.
2. **Step time while a hot save replicates**: a compute step of fixed cost (``--compute-iters`` matmuls
   of 512x512, one thread) is timed alone, then run back to back after ``save`` returns until the save's
   future completes; the steps that started while it was in flight are the "during" figure.  The
   background time (from ``save``'s return until its future completes) is recorded too.
3. **Recovery time** of ``load_latest`` in a fresh manager (a restarted job), the targets zeroed first and
   compared bitwise after with the copy arm's buffers (the state never changes): from the local tier (all
   intact: ``source == "local"``), from peers (node 1's directory moved away: ``"peer"``), from the
   durable root through the hot manager (both node directories moved away: ``"durable"``), the durable
   manager's load (no ``local=``), and torch DCP's ``dcp.load`` of the same state from the same disk;
   beside them the floor, the durable step's files read cold by the 4 ranks (a quarter each, nothing
   checked), and the floors of the hot recoveries (:mod:`peers_hot_floors`, which says why each is what it
   is), in the same rounds: each rank reading its own copy's files from its node's directory into a buffer of
   their size (``raw-local``), and node 0's ranks sending the bytes of node 1's ranks to them over gloo, one
   pair per lost rank, nothing else (``raw-transfer``: issue 40's floor, "a raw gloo transfer of the same
   bytes between the same ranks"); beside those, shown and not judged, the local read into one reused 8 MiB
   buffer (``raw-local-reused``) and the transfer while node 0's ranks read their own copies as ``raw-local``
   does (``raw-peer``: everything a recovery from peers does on every rank, raw).  Before the durable,
   DCP and raw-disk loads the files are evicted from the page cache:
   ``/proc/sys/vm/drop_caches`` when writable, else ``posix_fadvise(DONTNEED)`` on every file after
   ``sync`` (the report says which).  Every recovery starts after a 4 s pause, so the VM has handed
   freed memory back (what a restarted process sees).  A load's time is the job's, from the last rank's
   start to the last rank's end (:func:`job_wall` says why); the slowest rank's own time is kept too
   (``rank_s``), and the floor ratios on it are printed beside the targets.
   Targets: local <= 0.5x and peer <= 0.7x the durable manager's load; local <= 1.5x ``raw-local`` and
   peer <= 1.5x ``raw-transfer`` (their floors).
4. **Work lost per failure**, computed from the medians above for a run that fails every M steps (a node
   lost) and steps of ``T`` seconds without saving (the compute step measured alone, and ``--step-s``).
   One save (blocking ``b``, background ``B``, compute ``rho`` times slower while it runs) at the start of
   ``c`` seconds of compute makes them take ``b + max(c + B * (1 - 1/rho), B)`` (the next save waits for
   the last).  Hot every step + durable every 10: 9 hot saves and 1 hot+durable save per 10 steps of
   ``c = T``, recovery from peers; durable every 10 (the durable manager, async): one save per ``c = 10 T``,
   recovery from the durable root.  A save is usable ``b + B`` after the state it holds was taken, so a
   failure at a uniformly random moment loses ``b + B + I/2`` of work on average (``I`` the time between
   saves), and the time lost per failure is that, plus the recovery, plus the saving overhead paid over
   the M steps since the last failure (``M * (mean step - T)``).

    python benchmarks/hot_tier.py                 # ~0.8 GB, 5 rounds
    python benchmarks/hot_tier.py --quick         # a small state, 2 rounds (a smoke run)
    python benchmarks/hot_tier.py --sizes 5MB --rounds 1   # the smallest smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from statistics import median
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers_hot_floors as floors  # noqa: E402 - beside this file

import shardkit.checkpoint as skc  # noqa: E402 - this checkout first
from shardkit import fully_shard  # noqa: E402
from shardkit.checkpoint.state.tree import flatten  # noqa: E402

SAVES = ("copy", "hot", "hot+durable", "durable")
LOADS = ("local", "peer", "hot->durable", "durable", "dcp", "raw-disk", "raw-local", "raw-peer", "raw-local-reused",
         "raw-transfer")
DURABLE_EVERY, COLD_SLEEP_S, MATMUL = 10, 4.0, 512
LOCAL_TARGET, PEER_TARGET, BLOCKING_TARGET = 0.5, 0.7, 1.2
FLOOR_TARGET = 1.5  # local and peer recovery / their raw floors


# -- the state and the compute step -----------------------------------------


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The sharded model and its AdamW, after one step (so the optimizer state exists)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, args.dim)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def local_tensors(model: Any, opt: Any) -> list:
    state = skc.get_training_state(model, opt)
    return [t.to_local() if hasattr(t, "to_local") else t for t in flatten(state).tensors.values()]


def compute_step(iters: int) -> Callable[[], None]:
    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)

    def step() -> None:
        for _ in range(iters):
            torch.mm(a, b)
    return step


# -- measuring ---------------------------------------------------------------


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def job_wall(start: float, end: float) -> tuple[float, float]:
    """``(the job's time, the slowest rank's own time)`` of a load that ran from ``start`` to ``end`` on this
    rank (``time.monotonic``: one clock, the job runs on one machine).  The job's time -- the last rank's start
    to the last rank's end -- is what a load is judged by.  A rank's own time charges a load with collectives
    for how unevenly the ranks left the barrier before it (up to ~10 ms at 4 ranks on 2 cores: an early rank
    waits for the late ones in the first collective), which a floor without collectives never pays; timed
    from the first rank's start instead, both sides would pay that skew, which flatters every ratio.  From the
    last start, neither side pays it: a load's early ranks wait for the last one anyway, and a floor's last
    rank does all of its own work after it."""
    t = torch.tensor([start, end, end - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[1] - t[0]), float(t[2])


def gathered(values: list[float]) -> list[float]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return [v for rank in out for v in rank]


def timed_save(save: Callable[[], Any], step: Callable[[], None]) -> dict[str, Any]:
    """``save()`` (returns a future): its blocking time, then compute steps back to back until the future
    completes -- each step's time and the background time (slowest rank)."""
    dist.barrier()
    t0 = time.perf_counter()
    future = save()
    returned = time.perf_counter()
    finished: list[float] = []
    future.add_done_callback(lambda _: finished.append(time.perf_counter()))
    during = []
    while not future.done():
        t = time.perf_counter()
        step()
        during.append(time.perf_counter() - t)
    future.result()
    while not finished:  # the callback runs on the saver's thread just after done() turns true
        time.sleep(0.001)
    out = {"blocking": max_over_ranks(returned - t0), "background": max_over_ranks(finished[0] - returned),
           "during": gathered(during)}
    dist.barrier()
    return out


def evict(paths: list[str]) -> str:
    """Drop ``paths``' files from the page cache; how (``drop_caches`` or ``fadvise``)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for path in paths:
        for folder, _, files in os.walk(path):
            for name in files:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return "fadvise"


def move_aside(node_dirs: list[str], back: bool = False) -> None:
    """Node directories moved aside for one recovery (a wiped node), or (``back``) put back after it."""
    for d in node_dirs:
        if back:
            shutil.rmtree(d, ignore_errors=True)  # what the recovery left there (fetched copies are removed)
        os.rename(*((d + ".aside", d) if back else (d, d + ".aside")))


def read_share(root: str, rank: int, world: int) -> None:
    """Read every ``world``-th file of the newest step under ``root`` (this rank's share), through the page
    cache: the floor of a load from that disk."""
    newest = os.path.join(root, max(n for n in os.listdir(root) if n.startswith("step-")))
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(newest) for f in names)
    buf = bytearray(8 << 20)
    for path in files[rank::world]:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# -- the worker (one 4-rank job) ---------------------------------------------


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build(args)
    tensors = local_tensors(model, opt)
    buffers = [torch.empty_like(t) for t in tensors]
    wire = floors.peer_buffer(sum(t.numel() * t.element_size() for t in tensors))  # the peer floor's bytes
    step = compute_step(args.compute_iters)
    hot_template = os.path.join(args.shm, "node{node}")
    node_dirs = [hot_template.format(node=n) for n in range(2)]
    hot_root, durable_root, dcp_dir = (os.path.join(args.dir, n) for n in ("hot-durable", "durable", "dcp"))

    def hot_manager() -> Any:
        return skc.CheckpointManager(hot_root, keep_last=2, async_save=True, local=hot_template,
                                     local_world_size=2, replicas=1, local_keep=2, durable_every=DURABLE_EVERY)

    hot, durable = hot_manager(), skc.CheckpointManager(durable_root, keep_last=2, async_save=True)
    dcp.save(skc.get_training_state(model, opt), checkpoint_id=dcp_dir)
    counters = {"hot": 0, "durable": 0}

    def next_step(durable_step: bool) -> int:
        n = counters["hot"] + 1
        while (n % DURABLE_EVERY == 0) != durable_step:
            n += 1
        counters["hot"] = n
        return n

    def save_arm(arm: str) -> dict[str, Any]:
        if arm == "copy":
            dist.barrier()
            t0 = time.perf_counter()
            for buf, t in zip(buffers, tensors):
                buf.copy_(t)
            return {"blocking": max_over_ranks(time.perf_counter() - t0)}
        if arm == "durable":
            counters["durable"] += 1
            return timed_save(lambda: durable.save(counters["durable"], model, opt), step)
        n = next_step(arm == "hot+durable")
        return timed_save(lambda: hot.save(n, model, opt), step)

    def blocking_pairs(k: int) -> dict[str, list[float]]:
        """``k`` more samples of measurement 1's two arms, a plain copy and a hot save (not durable) in
        alternating order, each save waited for before the next sample (no compute steps in between): one
        sample per round was the machine's noise more than the save's."""
        found: dict[str, list[float]] = {"copy": [], "hot": []}
        for i in range(k):
            for arm in ("copy", "hot") if i % 2 == 0 else ("hot", "copy"):
                if arm == "copy":
                    found["copy"].append(save_arm("copy")["blocking"])
                    continue
                n = next_step(False)
                dist.barrier()
                t0 = time.perf_counter()
                future = hot.save(n, model, opt)
                found["hot"].append(max_over_ranks(time.perf_counter() - t0))
                future.result()
                dist.barrier()
        return found

    local_floor = torch.empty(0, dtype=torch.uint8)  # the local floor's buffer, once a copy exists (below)

    def read_own(into: torch.Tensor | None) -> None:
        """This rank's own copy read raw: into ``into`` (the local floor), or one reused buffer (``None``)."""
        files = floors.own_copy_files(hot_template.format(node=rank // 2), rank)
        got = floors.read_files(files, into) if into is not None else floors.read_files_reused(files)
        if got < wire.numel():
            raise SystemExit(f"raw-local: rank {rank} read {got} bytes of its local copy, holds {wire.numel()}")

    def load_arm(arm: str) -> dict[str, Any]:
        for t in tensors if not arm.startswith("raw") else []:
            t.zero_()
        how, aside = None, {"peer": node_dirs[1:], "hot->durable": node_dirs}.get(arm, [])
        if rank == 0:
            if arm in ("hot->durable", "durable", "dcp", "raw-disk"):
                how = evict([{"hot->durable": hot_root, "dcp": dcp_dir}.get(arm, durable_root)])
            move_aside(aside)
        time.sleep(COLD_SLEEP_S)
        dist.barrier()
        t0 = time.monotonic()
        source = "raw" if arm.startswith("raw") else {"dcp": "dcp"}.get(arm)
        if arm == "dcp":
            state = skc.get_training_state(model, opt)
            dcp.load(state, checkpoint_id=dcp_dir)
            skc.set_training_state(model, opt, state)
        elif arm == "raw-disk":
            read_share(durable_root, rank, dist.get_world_size())
        elif arm in ("raw-local", "raw-local-reused"):
            read_own(local_floor if arm == "raw-local" else None)
        elif arm in ("raw-peer", "raw-transfer"):
            floors.peer_transfer(wire, [2, 3], local_world_size=2,
                                 meanwhile=(lambda: read_own(local_floor)) if arm == "raw-peer" else None)
        else:
            manager = hot_manager() if arm != "durable" else skc.CheckpointManager(durable_root, keep_last=2)
            manager.load_latest(model, opt, required=True)
            source = manager.last_load.source
        seconds, own = job_wall(t0, time.monotonic())
        if rank == 0:
            move_aside(aside, back=True)
        want = {"local": "local", "peer": "peer", "hot->durable": "durable", "durable": "durable"}.get(arm, source)
        tensors[:] = local_tensors(model, opt)  # the same tensors unless a load replaced some: zero those next
        intact = arm.startswith("raw") or all(torch.equal(t, b) for t, b in zip(tensors, buffers))
        if source != want or not intact:
            raise SystemExit(f"{arm}: recovered from {source!r} (want {want!r}) or the state differs")
        dist.barrier()
        return {"s": seconds, "rank_s": own, "evicted_by": how}

    alone = []
    for _ in range(5):  # the compute step with nothing in flight (all ranks at once, as during the saves)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        alone.append(max_over_ranks(time.perf_counter() - t0))
    for arm in ("hot", "hot+durable", "durable"):  # warm-up: host buffers, saver thread and group, a first step
        save_arm(arm)
    # every later copy has the same files, of the same sizes
    local_floor = floors.local_buffer(floors.own_copy_files(hot_template.format(node=rank // 2), rank))
    out: dict[str, Any] = {"rank_bytes": sum(t.numel() * t.element_size() for t in tensors),
                           "world": dist.get_world_size(), "rounds": []}
    for r in range(args.rounds):
        rounds: dict[str, Any] = {}
        for arm in SAVES[r % len(SAVES):] + SAVES[:r % len(SAVES)]:
            rounds[f"save/{arm}"] = save_arm(arm)
        rounds["pairs"] = blocking_pairs(args.pairs)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        alone.append(max_over_ranks(time.perf_counter() - t0))
        for arm in LOADS[r % len(LOADS):] + LOADS[:r % len(LOADS)]:
            rounds[f"load/{arm}"] = load_arm(arm)
        out["rounds"].append(rounds)
        if rank == 0:
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    hot.wait()
    durable.wait()
    out["alone"] = alone
    if rank == 0:
        with open(os.path.join(args.dir, "result.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


# -- the report --------------------------------------------------------------


def _row(name: str, ours: float, anchor_name: str, anchor: float, limit: float | None) -> bool:
    ratio = ours / anchor if anchor > 0 else float("inf")
    verdict = "" if limit is None else ("MET" if ratio <= limit else "MISSED") + f" (<= {limit:.1f}x)"
    print(f"  {name:34s} {ours:9.3f} s  {anchor_name:30s} {anchor:9.3f} s  {ratio:7.2f}x  {verdict}")
    return limit is None or ratio <= limit


def report(out: dict[str, Any], fail_every: list[int],
           step_times: list[float]) -> list[tuple[str, float, float, bool]]:
    """Print one table per measurement; return the targets as ``(name, ratio, limit, met)``."""
    rounds = out["rounds"]

    def med(key: str, field: str = "s") -> float:
        return median([r[key][field] for r in rounds])

    alone = median(out["alone"])
    gb = out["rank_bytes"] * out["world"] / 1e9
    print(f"\nhot tier: {out['world']} gloo ranks as 2 nodes of 2, {gb:.2f} GB of state in all "
          f"({out['rank_bytes'] / 1e6:.0f} MB per rank, weights + AdamW), {len(rounds)} interleaved rounds, "
          f"medians of the slowest rank")
    header = f"  {'':34s} {'ours':>12s} {'anchor':30s} {'':>12s} {'ratio':>8s}  verdict"
    print("\n1. blocking time per save (async_save=True)")
    print(header)
    copy = med("save/copy", "blocking")
    targets = []
    hot_blocking = med("save/hot", "blocking")
    if "pairs" in rounds[0]:  # every sample of the two arms: the rounds' own and the pairs'
        def samples(arm: str) -> list[float]:
            return [r[f"save/{arm}"]["blocking"] for r in rounds] + [s for r in rounds for s in r["pairs"][arm]]
        copy, hot_blocking = median(samples("copy")), median(samples("hot"))
        print(f"  (medians of {len(rounds) * (1 + len(rounds[0]['pairs']['hot']))} samples of each of the first two "
              f"arms, {len(rounds[0]['pairs']['hot'])} interleaved pairs per round besides the round's own)")
    _row("hot save (not durable)", hot_blocking, "plain copy into preallocated", copy, BLOCKING_TARGET)
    targets.append(("blocking per hot save <= 1.2x a plain host copy", hot_blocking / copy, BLOCKING_TARGET,
                    hot_blocking / copy <= BLOCKING_TARGET))
    _row("hot save that is also durable", med("save/hot+durable", "blocking"), "plain copy into preallocated",
         copy, None)
    _row("durable manager's async save", med("save/durable", "blocking"), "plain copy into preallocated",
         copy, None)
    print("\n2. compute step while a save runs in the background (its fixed cost alone is the anchor)")
    print(header)
    for arm, label in (("hot", "hot save replicating"), ("hot+durable", "hot + durable save"),
                       ("durable", "durable manager's save")):
        during = [s for r in rounds for s in r[f"save/{arm}"]["during"]]
        if during:
            _row(f"step during {label}", median(during), "step alone", alone, None)
        else:
            print(f"  step during {label}: the save finished before a step started")
        print(f"  {'':34s} background {med(f'save/{arm}', 'background'):.3f} s, "
              f"{len(during)} steps over {len(rounds)} rounds")
    print("\n3. recovery (load_latest in a fresh manager; durable, DCP and raw read cold, evicted by "
          f"{rounds[0]['load/durable']['evicted_by']})")
    print(header)
    durable = med("load/durable")
    for arm, label, limit in (("local", "from the local tier", LOCAL_TARGET), ("peer", "from peers (node 1 wiped)",
                              PEER_TARGET), ("hot->durable", "from the durable root (hot lost)", None),
                              ("dcp", "torch DCP load, same state", None),
                              ("raw-disk", "raw read of the durable step", None)):
        met = _row(label, med(f"load/{arm}"), "durable manager's load", durable, limit)
        if limit is not None:
            targets.append((f"recovery {label} <= {limit}x the durable manager's load",
                            med(f"load/{arm}") / durable, limit, met))
    print(f"  {'durable manager load_latest':34s} {durable:9.3f} s")
    for arm, label, floor, floor_label in (("local", "from the local tier", "raw-local", "raw read of own local copy"),
                                           ("peer", "from peers (node 1 wiped)", "raw-transfer",
                                            "raw gloo transfer, same pairs")):
        if f"load/{floor}" not in rounds[0]:
            continue  # results kept before the floors were measured
        met = _row(label, med(f"load/{arm}"), floor_label, med(f"load/{floor}"), FLOOR_TARGET)
        targets.append((f"recovery {label} <= {FLOOR_TARGET}x its floor ({floor})",
                        med(f"load/{arm}") / med(f"load/{floor}"), FLOOR_TARGET, met))
        shown = {"raw-local": ("raw-local-reused", "raw read into one 8 MiB buffer"),
                 "raw-transfer": ("raw-peer", "the transfer + survivors' own reads")}[floor]
        if f"load/{shown[0]}" in rounds[0]:  # the narrower floors, shown (not judged): see peers_hot_floors
            _row(label, med(f"load/{arm}"), shown[1], med(f"load/{shown[0]}"), None)
        if "rank_s" in rounds[0][f"load/{arm}"]:
            _row(f"{label.split(' (')[0]}, own time", med(f"load/{arm}", "rank_s"), f"{floor}, slowest rank's own time",
                 med(f"load/{floor}", "rank_s"), None)
    _work_lost(rounds, alone, med, fail_every, step_times)
    return targets


def _work_lost(rounds: list[dict], alone: float, med: Callable[..., float], fail_every: list[int],
               step_times: list[float]) -> None:
    """Measurement 4 (the model in the module docstring), for the measured step and ``step_times``."""
    def save(arm: str) -> tuple[float, float, float]:
        steps = [s for r in rounds for s in r[f"save/{arm}"]["during"]]
        slowdown = max(1.0, median(steps) / alone) if steps else 1.0
        return med(f"save/{arm}", "blocking"), med(f"save/{arm}", "background"), slowdown

    def saving(arm: str, compute: float) -> float:
        """Wall time of ``compute`` seconds of steps with one save of ``arm`` at their start."""
        b, bg, slowdown = save(arm)
        return b + max(compute + bg * (1 - 1 / slowdown), bg)

    print(f"\n4. work lost per failure (a node lost), a failure every M steps; T = the step without saving "
          f"(measured: {alone:.3f} s)")
    print(f"  {'run':34s} {'T s':>6s} {'M':>5s} {'step s':>7s} {'lost steps':>10s} {'lost work s':>11s} "
          f"{'recovery s':>10s} {'overhead s':>10s} {'lost per failure s':>18s}")
    for t in [alone] + step_times:
        hot_period = (9 * saving("hot", t) + saving("hot+durable", t)) / 10
        durable_period = saving("durable", 10 * t) / 10
        runs = {"hot every step + durable every 10": (hot_period, sum(save("hot")[:2]) + hot_period / 2,
                                                      med("load/peer")),
                "durable every 10": (durable_period, sum(save("durable")[:2]) + 10 * durable_period / 2,
                                     med("load/durable"))}
        for m in fail_every:
            totals = []
            for name, (period, lost, recovery) in runs.items():
                overhead = m * (period - t)
                totals.append(lost + recovery + overhead)
                print(f"  {name:34s} {t:6.2f} {m:5d} {period:7.3f} {lost / period:10.2f} {lost:11.2f} "
                      f"{recovery:10.2f} {overhead:10.2f} {totals[-1]:18.2f}")
            print(f"  {'':34s} {'':6s} {'':5s} hot / durable: {totals[0] / totals[1]:.2f}x the time lost per failure")


# -- the driver --------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small state and 2 rounds (a smoke run)")
    parser.add_argument("--gb", type=float, default=0.8, help="state in all (weights + AdamW), GB")
    parser.add_argument("--sizes", default=None, help="the state in all as a size, e.g. 5MB (one size; "
                        "instead of --gb)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=6, help="more interleaved samples per round of measurement "
                        "1's copy and hot save (their blocking medians are over every sample)")
    parser.add_argument("--compute-iters", type=int, default=12, help="512x512 matmuls in one compute step")
    parser.add_argument("--fail-every", default="100,1000", help="M: steps between failures, comma-separated")
    parser.add_argument("--step-s", default="2,10", help="step times (s) to model measurement 4 for, besides "
                        "the measured compute step, comma-separated")
    parser.add_argument("--json", default=None, help="also keep the raw results here")
    parser.add_argument("--report", default=None, metavar="JSON", help="run nothing: print the report of the "
                        "results an earlier run kept with --json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shm", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.report:
        with open(args.report) as f:
            out = json.load(f)
    else:
        out = run_job(args)
    targets = report(out, [int(m) for m in args.fail_every.split(",")], [float(t) for t in args.step_s.split(",") if t])
    print("\ntargets")
    for name, ratio, limit, met in targets:
        print(f"  {name:72s} {ratio:6.2f}x (<= {limit:.1f}x)  {'MET' if met else 'MISSED'}")


def run_job(args: argparse.Namespace) -> dict[str, Any]:
    """The 4-rank job under torchrun; its results (kept in ``--json`` when given)."""
    if args.quick:
        args.gb, args.rounds = 0.02, 2
    elif args.sizes:
        import peers_systems

        args.gb = peers_systems.parse_size(args.sizes) / 1e9
    dim = 2048 if args.gb >= 0.2 else 512
    layers = max(1, round(args.gb * 1e9 / (12 * dim * dim) + 0.499))  # rounded up: at least --gb
    work = tempfile.mkdtemp(prefix="shardkit-hot-bench-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    shm = tempfile.mkdtemp(prefix="shardkit-hot-bench-", dir="/dev/shm")
    try:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                   os.path.abspath(__file__), "--worker", "--dim", str(dim), "--layers", str(layers),
                   "--rounds", str(args.rounds), "--pairs", str(args.pairs), "--compute-iters", str(args.compute_iters),
                   "--dir", work,
                   "--shm", shm]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(os.path.join(work, "result.json")) as f:
            out = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
