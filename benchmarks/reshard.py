"""Offline reshard of a >= 4 GB checkpoint: shardkit vs the disk vs torch's dcp_to_torch_save.

In one run, each measured op in a fresh process (so peak RSS is the op's own),
with the page cache dropped before each op so all read from the disk:

* ``shardkit reshard SRC DST --world-size 3`` on a 2-rank native checkpoint
  (default ``--max-memory`` 256 MiB): seconds and peak RSS;
* the disk figure: copying the same data files with plain file I/O (8 MiB
  reads/writes, fsync at the end, as the reshard does);
* torch's ``format_utils.dcp_to_torch_save`` on the same tensors in DCP form:
  seconds and peak RSS.

* ``shardkit verify`` of the source (every crc32c block) against plainly reading
  the same files (the "runs at disk speed" claim).

The reshard and the copy alternate ``--repeat`` times; medians are reported,
with the ratios against the targets (peak RSS <= 600 MB; time <= 1.3x the copy).
``--cache cold`` (default) drops the page cache before every op; ``--cache warm``
does not, so sources are read from the page cache (close to a fast disk).

    python benchmarks/reshard.py --gb 4.3 --dir /tmp/shardkit-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any, Mapping, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardkit.checkpoint.formats.base import CheckpointInfo, CheckpointReader, ReadRequest, StoredChunk, TensorEntry  # noqa: E402


class SyntheticReader(CheckpointReader):
    """LLaMA-like fp32 tensors whose values depend only on their global position (no RAM needed)."""

    def __init__(self, total_bytes: float) -> None:
        super().__init__()
        shapes: dict[str, tuple[int, ...]] = {"model.tok_embeddings.weight": (32000, 4096)}
        layer = 0
        while sum(4 * torch.Size(s).numel() for s in shapes.values()) < total_bytes:
            shapes[f"model.layers.{layer}.feed_forward.w1.weight"] = (14336, 4096)
            shapes[f"model.layers.{layer}.attention.wq.weight"] = (4096, 4096)
            shapes[f"model.layers.{layer}.attention_norm.weight"] = (4096,)
            layer += 1
        self._entries = {k: TensorEntry(k, torch.float32, s, (StoredChunk((0,) * len(s), s, None),))
                         for k, s in shapes.items()}
        self.info = CheckpointInfo("synthetic", "synthetic://")

    def tensors(self) -> Mapping[str, TensorEntry]:
        return self._entries

    def values(self) -> Mapping[str, Any]:
        return {"step": 1000}

    def read(self, requests: Sequence[ReadRequest]) -> None:
        for r in requests:
            shape = self._entries[r.fqn].shape
            row = shape[1] if len(shape) > 1 else 1
            start = r.box[0][0] * row
            n = r.out.numel()
            vals = torch.arange(start, start + n, dtype=torch.float64).remainder_(65521).to(torch.float32)
            r.out.copy_((vals * 1e-3 + (hash(r.fqn) % 97)).reshape(r.out.shape))


CACHE = {"mode": "cold"}


def drop_caches() -> None:
    os.sync()
    if CACHE["mode"] != "cold":
        return
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def _hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """Run ``cmd`` in a fresh process; (seconds, peak RSS bytes, stderr tail).

    Peak RSS is the child's own high-water mark (``VmHWM``, which starts afresh
    at exec), sampled every 10 ms until it exits; ``ru_maxrss`` from ``wait4``
    would include this (large) parent's RSS, which Linux carries across fork.
    """
    drop_caches()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _hwm(proc.pid))
        time.sleep(0.01)
    seconds = time.perf_counter() - start
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {err[-2000:]}")
    return seconds, peak, err.strip().splitlines()[-1] if err.strip() else ""


COPY = r"""
import os, sys
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
buf = bytearray(8 << 20)
view = memoryview(buf)
for root, _, files in os.walk(src):
    for name in files:
        rel = os.path.relpath(os.path.join(root, name), src)
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        with open(os.path.join(root, name), "rb", buffering=0) as i, open(os.path.join(dst, rel), "wb", buffering=0) as o:
            while True:
                n = i.readinto(buf)
                if not n:
                    break
                o.write(view[:n])
            os.fsync(o.fileno())
"""

COPY_DIRECT = r"""
import fcntl, mmap, os, sys
src, dst = sys.argv[1], sys.argv[2]
buf = mmap.mmap(-1, 8 << 20)  # page-aligned, as O_DIRECT needs
for root, _, files in os.walk(src):
    for name in files:
        rel = os.path.relpath(os.path.join(root, name), src)
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        fin = os.open(os.path.join(root, name), os.O_RDONLY)
        fout = os.open(os.path.join(dst, rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        while True:
            n = os.readv(fin, [buf])
            if not n:
                break
            if n % 4096:  # the unaligned tail is written without O_DIRECT
                fcntl.fcntl(fout, fcntl.F_SETFL, fcntl.fcntl(fout, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.write(fout, memoryview(buf)[:n])
        os.fsync(fout)
        os.close(fin)
        os.close(fout)
"""

READ = r"""
import os, sys
buf = bytearray(8 << 20)
for root, _, files in os.walk(sys.argv[1]):
    for name in files:
        with open(os.path.join(root, name), "rb", buffering=0) as i:
            while i.readinto(buf):
                pass
"""

DCP_TO_TORCH = r"""
import sys, warnings
warnings.simplefilter("ignore")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""


def du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.3, help="checkpoint size in GB (>= 4 for the must-show)")
    ap.add_argument("--dir", default="/tmp/shardkit-bench")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-memory", default="256MiB")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    ap.add_argument("--cache", choices=["cold", "warm"], default="cold")
    args = ap.parse_args()
    CACHE["mode"] = args.cache

    from shardkit.checkpoint.offline_native import write_native
    from shardkit.checkpoint.offline_select import select
    from shardkit.checkpoint.storage import Storage

    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    src, dcp_dir = f"{root}/src-ws2", f"{root}/dcp"
    t0 = time.perf_counter()
    reader = SyntheticReader(args.gb * 1e9)
    sel = select(reader.tensors(), reader.values())
    write_native(reader, sel, Storage(src), world_size=2, mesh=None, compression=None, budget=256 << 20,
                 workers=2, progress=None, source_id="synthetic")
    size = du(f"{src}/data")
    print(f"source: 2-rank shardkit checkpoint, {len(sel.tensors)} fp32 tensors, {size / 1e9:.2f} GB of data "
          f"files (built in {time.perf_counter() - t0:.0f} s)")
    subprocess.run([sys.executable, "-m", "shardkit", "-q", "convert", src, dcp_dir, "--to", "dcp"], check=True)
    print(f"same tensors in DCP form: {du(dcp_dir) / 1e9:.2f} GB")

    reshard_s, reshard_rss, copy_s, copy_rss, verify_s, read_s, direct_s = [], [], [], [], [], [], []
    for i in range(args.repeat):
        dst, cp = f"{root}/dst-ws3", f"{root}/copy"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(cp, ignore_errors=True)
        s, rss, _ = timed([sys.executable, "-m", "shardkit", "-q", "reshard", src, dst, "--world-size", "3",
                           "--max-memory", args.max_memory, "--workers", str(args.workers)])
        reshard_s.append(s)
        reshard_rss.append(rss)
        s, rss, _ = timed([sys.executable, "-c", COPY, f"{src}/data", cp])
        copy_s.append(s)
        copy_rss.append(rss)
        shutil.rmtree(cp, ignore_errors=True)
        direct_s.append(timed([sys.executable, "-c", COPY_DIRECT, f"{src}/data", cp])[0])
        verify_s.append(timed([sys.executable, "-m", "shardkit", "-q", "verify", src])[0])
        read_s.append(timed([sys.executable, "-c", READ, f"{src}/data"])[0])
        print(f"run {i + 1}: reshard {reshard_s[-1]:.2f} s, peak RSS {reshard_rss[-1] / 1e6:.0f} MB | "
              f"plain copy {copy_s[-1]:.2f} s, O_DIRECT copy {direct_s[-1]:.2f} s | verify {verify_s[-1]:.2f} s | plain read {read_s[-1]:.2f} s")
    check = subprocess.run([sys.executable, "-m", "shardkit", "-q", "diff", src, f"{root}/dst-ws3"],
                           capture_output=True, text=True)
    print(f"diff src dst-ws3: exit {check.returncode}: {check.stdout.strip().splitlines()[-1]}")
    shutil.rmtree(f"{root}/copy", ignore_errors=True)
    shutil.rmtree(f"{root}/dst-ws3", ignore_errors=True)
    pt = f"{root}/dcp.pt"
    dcp_s, dcp_rss, _ = timed([sys.executable, "-c", DCP_TO_TORCH, dcp_dir, pt])
    os.unlink(pt)

    r_s, r_rss = statistics.median(reshard_s), max(reshard_rss)
    c_s = min(statistics.median(copy_s), statistics.median(direct_s))  # the better of the two disk figures
    gb = size / 1e9
    rows = [
        ("shardkit reshard 2 -> 3 ranks", r_s, gb / r_s, r_rss),
        ("plain copy, buffered", statistics.median(copy_s), gb / statistics.median(copy_s), statistics.median(copy_rss)),
        ("plain copy, O_DIRECT writes", statistics.median(direct_s), gb / statistics.median(direct_s), 0),
        ("torch dcp_to_torch_save", dcp_s, gb / dcp_s, dcp_rss),
        ("shardkit verify (all crc32c)", statistics.median(verify_s), gb / statistics.median(verify_s), 0),
        ("plain file read (the disk)", statistics.median(read_s), gb / statistics.median(read_s), 0),
    ]
    print(f"\n{args.cache} page cache, {args.repeat} runs (medians)")
    print(f"{'op':32s} {'seconds':>8s} {'GB/s':>6s} {'peak RSS MB':>12s}")
    for name, s, rate, rss in rows:
        print(f"{name:32s} {s:8.2f} {rate:6.2f} {rss / 1e6 if rss else float('nan'):12.0f}")
    print(f"\nreshard / copy time: {r_s / c_s:.2f}x against the faster plain copy (target <= 1.3x)")
    print(f"reshard peak RSS: {r_rss / 1e6:.0f} MB (target <= 600 MB; budget {args.max_memory})")
    print(f"reshard vs dcp_to_torch_save: {dcp_s / r_s:.1f}x faster, {dcp_rss / r_rss:.1f}x less memory")
    print(f"verify / plain read time: {statistics.median(verify_s) / statistics.median(read_s):.2f}x")
    print(json.dumps({"gb": gb, "cache": args.cache, "reshard_s": reshard_s, "reshard_rss": reshard_rss,
                      "copy_s": copy_s, "direct_copy_s": direct_s, "verify_s": verify_s, "read_s": read_s,
                      "dcp_to_torch_save_s": dcp_s, "dcp_to_torch_save_rss": dcp_rss}))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
