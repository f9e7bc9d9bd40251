"""Training while a checkpoint is written: how much each async save costs the training loop.

One 2-rank job (``torchrun``) trains the runtime benchmark's Transformer
(shardkit ``fully_shard`` per block and at the root, AdamW) and, arm after arm
in a rotating order, runs ``--train-steps`` steps saving model + optimizer
every ``--save-every`` steps with:

* ``none``: no saving (the baseline step time);
* ``host-copy``: at every save point, a plain copy of the local shards into
  host buffers allocated before the loop, and nothing written (the floor for
  a save's blocking time, measured where and when the saves block);
* ``shardkit-process``: ``async_save`` (the default writer process per rank);
* ``shardkit-thread``: ``async_save(writer="thread")``;
* ``dcp-thread``: ``dcp.async_save`` (its background thread);
* ``dcp-process``: ``dcp.async_save(async_checkpointer_type=PROCESS)``.

Every arm first saves once, untimed, so writer processes exist and staging
buffers are allocated (the steady state of a long run).  Per arm we record the
blocking time of each save call (the slowest rank), each step's wall time
(steps start on a barrier; the slowest rank) and whether a save was still
being written when the step started, and the total time for the steps plus
the wait for the last save to commit.  The blocking targets divide by the
``host-copy`` arm's copy time; the same copy timed once before the arms, out of
the training loop, is printed beside it.
Both systems save the same state dict (shardkit's ``get_training_state``: DTensors).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
ARMS = ("none", "host-copy", "shardkit-process", "shardkit-thread", "dcp-thread", "dcp-process")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-steps", type=int, default=24, help="timed training steps per arm")
    parser.add_argument("--save-every", type=int, default=4, help="steps between saves")
    parser.add_argument("--train-dim", type=int, default=512)
    parser.add_argument("--train-layers", type=int, default=8)


def _model(args: argparse.Namespace):
    import torch

    sys.path.insert(0, str(REPO))
    from shardkit import fully_shard
    from tests.support.models import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=8192, dim=args.train_dim, n_heads=8, n_layers=args.train_layers,
                                  ffn_dim=3 * args.train_dim, max_seq_len=128))
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, opt, tokens) -> None:
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def _host_copier(state: dict) -> Callable[[list, str], None]:
    """A "save" that only copies the local shards (found before the clock starts: see ``_run_arm``)
    into buffers allocated here, once."""
    import torch

    buffers = [torch.empty_like(t) for t in _local_tensors(state)]

    def copy(tensors: list, url: str) -> None:
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor)
    return copy


def _starter(arm: str, group: Any, state: dict) -> Callable[[dict, str], Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import shardkit.checkpoint as skc

    if arm == "host-copy":
        return _host_copier(state)
    if arm.startswith("shardkit"):
        writer = arm.split("-")[1]
        return lambda state, url: skc.async_save(state, url, writer=writer, process_group=group)
    kind = AsyncCheckpointerType.PROCESS if arm == "dcp-process" else AsyncCheckpointerType.THREAD
    return lambda state, url: dcp.async_save(state, checkpoint_id=url, process_group=group,
                                             async_checkpointer_type=kind)


def _wait(future: Any) -> None:
    if future is not None:
        future.result()


def _done(future: Any) -> bool:
    return future is None or future.done()


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _run_arm(arm: str, model, opt, state_of: Callable[[], dict], args: argparse.Namespace, root: str,
             group: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    start_save = None if arm == "none" else _starter(arm, group, state_of())

    def capture() -> Any:  # what one save is handed: the state dict, or for host-copy its local shards
        return _local_tensors(state_of()) if arm == "host-copy" else state_of()

    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    tokens = [torch.randint(0, 8192, (4, 129), generator=gen) for _ in range(args.train_steps)]
    if start_save is not None:  # the steady state: writer processes started, staging allocated
        _wait(start_save(capture(), os.path.join(root, f"{arm}-warmup")))
    dist.barrier()
    steps, writing, blocking, future = [], [], [], None
    began = time.perf_counter()
    for i in range(args.train_steps):
        if start_save is not None and i % args.save_every == 0:
            _wait(future)
            state = capture()
            t0 = time.perf_counter()
            future = start_save(state, os.path.join(root, f"{arm}-{i}"))
            blocking.append(_max_over_ranks(time.perf_counter() - t0))
        in_flight = _max_over_ranks(0.0 if _done(future) else 1.0) > 0
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, opt, tokens[i])
        steps.append(_max_over_ranks(time.perf_counter() - t0))
        writing.append(in_flight)
    _wait(future)
    dist.barrier()
    total = _max_over_ranks(time.perf_counter() - began)
    return {"steps": steps, "writing": writing, "blocking": blocking, "total": total}


def _local_tensors(state: dict) -> list:
    from torch.distributed.tensor import DTensor

    from shardkit.checkpoint.state.tree import flatten

    return [t.to_local() if isinstance(t, DTensor) else t for t in flatten(state).tensors.values()]


def _copy_baseline(state: dict) -> float:
    """Median time of copying the local shards into preallocated host buffers (the floor for blocking)."""
    import torch

    tensors = _local_tensors(state)
    buffers = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors):
            b.copy_(t)
        times.append(_max_over_ranks(time.perf_counter() - t0))
    return statistics.median(times)


def worker(args: argparse.Namespace, rep: int) -> dict[str, Any]:
    """One 2-rank job: every arm in a rotating order (called under torchrun)."""
    import torch
    import torch.distributed as dist

    from shardkit.checkpoint import get_training_state

    model, opt = _model(args)
    gen = torch.Generator().manual_seed(99)
    for _ in range(3):  # warm-up: optimizer state exists before the first save
        _step(model, opt, torch.randint(0, 8192, (4, 129), generator=gen))
    group = dist.new_group(backend="gloo")  # the saves' own group, as in the main benchmark

    def state_of() -> dict:
        return get_training_state(model, opt)

    out: dict[str, Any] = {"copy_to_host_s": _copy_baseline(state_of()),
                           "rank_state_bytes": sum(t.numel() * t.element_size() for t in _local_tensors(state_of()))}
    root = os.path.join(args.dir, "train")
    order = ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]
    for arm in order:
        out[arm] = _run_arm(arm, model, opt, state_of, args, root, group)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    return out


def report(runs: list[dict[str, Any]], save_every: int) -> list[tuple[str, float, float, bool]]:
    """Print the table; return the targets as ``(name, ours, limit, met)``."""
    med = statistics.median
    copy = med(b for r in runs for b in r["host-copy"]["blocking"])
    copy_before = med(r["copy_to_host_s"] for r in runs)
    base = med(s for r in runs for s in r["none"]["steps"])
    print(f"\ntraining while saving: 2 ranks, {runs[0]['rank_state_bytes'] / 1e6:.0f} MB of state per rank, "
          f"a save every {save_every} steps, {len(runs)} jobs (arms interleaved), medians")
    print(f"  copy of the local shards into preallocated host buffers: {copy:.4f} s at the save points "
          f"(the host-copy arm: 'x copy' divides by it), {copy_before:.4f} s before the loop;  "
          f"step time, no saving: {base * 1e3:.0f} ms")
    print(f"  {'arm':18s} {'blocking s':>10s} {'x copy':>7s} {'step ms while writing':>22s} {'+ vs none':>10s} "
          f"{'steps written over':>18s} {'total s':>8s}")
    rows: dict[str, tuple[float, float]] = {}
    for arm in ARMS:
        steps = [s for r in runs for s, w in zip(r[arm]["steps"], r[arm]["writing"]) if w]
        blocking = [b for r in runs for b in r[arm]["blocking"]]
        total = med(r[arm]["total"] for r in runs)
        during = med(steps) if steps else float("nan")
        increase = during - base if steps else 0.0
        rows[arm] = (med(blocking) if blocking else 0.0, increase)
        print(f"  {arm:18s} {rows[arm][0]:10.4f} {rows[arm][0] / copy:6.2f}x {during * 1e3:22.0f} "
              f"{increase * 1e3:+9.0f}ms {len(steps):18d} {total:8.2f}")
    dcp_increase = min(rows["dcp-thread"][1], rows["dcp-process"][1])
    targets = []
    for arm in ("shardkit-process", "shardkit-thread"):
        targets.append((f"{arm} blocking <= 1.2x copy to host", rows[arm][0] / copy, 1.2, rows[arm][0] / copy <= 1.2))
    ratio = rows["shardkit-process"][1] / dcp_increase if dcp_increase > 0 else float("inf")
    targets.append(("shardkit-process step-time increase <= 0.5x DCP's (the better DCP mode)", ratio, 0.5,
                    ratio <= 0.5))
    return targets
