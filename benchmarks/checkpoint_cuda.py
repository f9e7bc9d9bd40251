"""GPU-resident state: what a checkpoint costs the training stream, shardkit vs torch.distributed.checkpoint.

One process, one GPU, a LLaMA-shaped fp32 state (weights + AdamW's two
moments, ``--gb`` GB) on the device.  Interleaved over ``--reps`` rounds:

* **copy** -- the floor: every tensor into preallocated page-locked host
  buffers (``non_blocking``), then a synchronize;
* **async save** -- ``skc.async_save`` (writer process, page-locked staging
  reused from save to save) and ``dcp.async_save`` with DCP's own pinned
  stager (``DefaultStager``: page-locked, non-blocking copies, staged in the
  background; one stager for every save, so its pinned buffers are reused),
  each after one untimed save so staging exists (the steady state of a run):
  *blocking* is the call, *stream* until the state may change (shardkit: the
  training stream synchronized -- kernels queued after the save wait for its
  copy; DCP: its staging finished, then the stream synchronized), *done*
  until the save committed;
* **save** and **load** of the same state; before a load its files are read
  once (shardkit's ``O_DIRECT`` save leaves none in the page cache, DCP's
  buffered one all), so both load from the page cache.

Targets: shardkit's blocking time <= DCP's, its stream time <= 1.2x the copy
and <= DCP's, its page-cached load <= DCP's.  Each is printed as a
``FIGURE ... MET|MISSED`` line too (``benchmarks/gpu_check.sh`` collects them).

    python benchmarks/checkpoint_cuda.py --gb 2 --reps 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from save_load_minimal import llama_shapes  # noqa: E402

import shardkit.checkpoint as skc  # noqa: E402 - this checkout first


def make_state(gb: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = llama_shapes(gb)

    def rand(shape):
        return torch.randn(shape, device="cuda", generator=gen)
    return {"model": {k: rand(s) for k, s in shapes.items()},
            "optim": {k: {"exp_avg": rand(s), "exp_avg_sq": rand(s)} for k, s in shapes.items()}}


def tensors(state: dict) -> list[torch.Tensor]:
    out = []
    for v in state.values():
        out.extend(tensors(v) if isinstance(v, dict) else [v])
    return out


def warm_cache(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(64 << 20):
                    pass


def dcp_pinned_stager():
    """DCP's page-locked background stager and its name; ``(None, "default")`` on a torch without one."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None, "default stager"
    options = StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                             use_non_blocking_copy=True)
    return DefaultStager(options), "DefaultStager, pinned"


def completions(response):
    """(staging finished or ``None``, save committed) of what an ``async_save`` returned: a future, or
    DCP's ``AsyncSaveResponse`` when its stager stages in the background."""
    if hasattr(response, "upload_completion"):
        return response.staging_completion, response.upload_completion
    return None, response


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, else ``sys.argv``), checked; what ``main`` runs on."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/shardkit-cuda-bench")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    state = make_state(args.gb)
    flat = tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in flat)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in flat]
    stager, stager_name = dcp_pinned_stager()
    starters = {"shardkit": lambda url: skc.async_save(state, url),
                "dcp": lambda url: dcp.async_save(state, checkpoint_id=url, async_stager=stager)}
    for system, start in starters.items():  # staging allocated, writer process started
        completions(start(f"{args.dir}/{system}-warmup"))[1].result()
    rows: dict[str, list[float]] = {}
    systems = list(starters)
    for rep in range(args.reps):
        rows.setdefault("copy", []).append(timed(lambda: [b.copy_(t, non_blocking=True) for b, t in zip(pinned, flat)]))
        for system in systems[rep % 2:] + systems[:rep % 2]:
            url = f"{args.dir}/{system}-{rep}"
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            staged, future = completions(starters[system](url))
            t1 = time.perf_counter()
            if staged is not None:
                staged.result()
            torch.cuda.current_stream().synchronize()
            t2 = time.perf_counter()
            future.result()
            t3 = time.perf_counter()
            for name, value in (("blocking", t1 - t0), ("stream", t2 - t0), ("done", t3 - t0)):
                rows.setdefault(f"{system}/{name}", []).append(value)
            rows.setdefault(f"{system}/save", []).append(timed(
                lambda: skc.save(state, url + "-sync") if system == "shardkit" else
                dcp.save(state, checkpoint_id=url + "-sync")))
            warm_cache(url + "-sync")
            rows.setdefault(f"{system}/load", []).append(timed(
                lambda: skc.load(state, url + "-sync") if system == "shardkit" else
                dcp.load(state, checkpoint_id=url + "-sync")))
            shutil.rmtree(url, ignore_errors=True)
            shutil.rmtree(url + "-sync", ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{torch.cuda.get_device_name()}: {nbytes / 1e9:.2f} GB in {len(flat)} tensors on the GPU, "
          f"median of {args.reps} interleaved rounds; DCP's async_save with {stager_name}")
    print(f"  copy to preallocated page-locked host buffers: {med['copy']:.3f} s "
          f"({nbytes / med['copy'] / 1e9:.1f} GB/s)")
    print(f"  {'':10s} {'blocking':>9s} {'stream':>9s} {'x copy':>7s} {'done':>7s} {'save':>7s} {'load':>7s}")
    for system in systems:
        print(f"  {system:10s} {med[f'{system}/blocking']:9.3f} {med[f'{system}/stream']:9.3f} "
              f"{med[f'{system}/stream'] / med['copy']:6.2f}x {med[f'{system}/done']:7.2f} "
              f"{med[f'{system}/save']:7.2f} {med[f'{system}/load']:7.2f}")
    ours, theirs = med["shardkit/stream"], med["dcp/stream"]
    print("targets")
    for name, value, limit in (("async_save blocking, shardkit / DCP pinned stager",
                                med["shardkit/blocking"] / med["dcp/blocking"], 1.0),
                               ("async_save stream time, shardkit / copy", ours / med["copy"], 1.2),
                               ("async_save stream time, shardkit / DCP pinned stager", ours / theirs, 1.0),
                               ("load into the GPU (page-cached), shardkit / DCP",
                                med["shardkit/load"] / med["dcp/load"], 1.0)):
        print(f"FIGURE {args.gb:g} GB: {name}: {value:.2f} (<= {limit:.2f}) {'MET' if value <= limit else 'MISSED'}")
    if stager is not None:
        stager.close()
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
