"""The 4-rank job of ``benchmarks/hot_tier.py`` (its docstring says what is measured and why): the sharded state
and the compute step, the save, recovery and floor arms, interleaved over the rounds; rank 0 keeps the figures
in ``--dir``/result.json for the driver's report (:mod:`hot_tier_report`)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any, Callable

import checkpoint_targets as targets  # beside this file (hot_tier.py puts benchmarks/ on sys.path)
import peers_hot_floors as floors
import peers_systems as ps
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from checkpoint_measure import max_over_ranks, rotated

import shardkit.checkpoint as skc
from shardkit import fully_shard
from shardkit.checkpoint.state.tree import flatten

SAVES = ("copy", "hot", "hot+durable", "durable")
LOADS = ("local", "peer", "hot->durable", "durable", "dcp", "raw-disk", "raw-local", "raw-peer", "raw-local-reused",
         "raw-transfer")
DURABLE_EVERY, COLD_SLEEP_S, MATMUL = 10, 4.0, 512


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
    return [ps.local(t) for t in flatten(state).tensors.values()]


def compute_step(iters: int) -> Callable[[], None]:
    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)

    def step() -> None:
        for _ in range(iters):
            torch.mm(a, b)
    return step


# -- measuring ---------------------------------------------------------------


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
    if targets.drop_page_cache():
        return "drop_caches"
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
    targets.read_sequentially(files[rank::world])


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
        for arm in rotated(SAVES, r):
            rounds[f"save/{arm}"] = save_arm(arm)
        rounds["pairs"] = blocking_pairs(args.pairs)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        alone.append(max_over_ranks(time.perf_counter() - t0))
        for arm in rotated(LOADS, r):
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
