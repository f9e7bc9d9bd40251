"""A load whose replicated bytes travel over NCCL: read from storage once, checked bitwise on every rank.

One job of ``--ranks`` NCCL ranks, one GPU each (at least 2), loads a
checkpoint saved here into an HSDP layout -- ``(Replicate(), Shard(0))`` on a
``(2, ranks / 2)`` mesh, GPU targets -- plus a plain host tensor every rank
loads.  Every byte two ranks need is read by one of them and sent to the
other over NCCL: a block of a contiguous GPU target in place, small blocks
packed and host targets through the transfer buffer on the GPU (host
targets through its page-locked twin).  Each rank counts the data bytes it
asks of storage.

Figures: every target equals the saved tensors bitwise (MET or MISSED), and
the bytes all ranks asked of storage / the checkpoint's bytes (<= 1.05: read
once; every replica reading its own would ask for 2x).

    python benchmarks/shared_reads_nccl.py --ranks 2 --mb 600
    python benchmarks/shared_reads_nccl.py --device cpu --mb 4   # the same job on gloo ranks: a dry run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _truth(mb: float) -> dict:
    """The saved state (CPU), the same in every process: two matrices whose rows the ranks shard and a
    vector every rank loads whole into host memory."""
    import torch

    g = torch.Generator().manual_seed(11)
    rows = max(8, int(mb * 2**20 / 4 / 2 / 1024))
    return {"model.w": torch.randn(rows, 1024, generator=g),
            "model.emb": torch.randn(rows, 1024, generator=g).to(torch.bfloat16).float(),
            "host.table": torch.randint(-2**31, 2**31 - 1, (4099,), generator=g, dtype=torch.int64)}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardkit.checkpoint as skc
    from shardkit.checkpoint.io.storage import Storage

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh(args.device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    truth = _truth(args.mb)
    state = {k: (torch.zeros_like(v) if k.startswith("host.") else
                 distribute_tensor(torch.zeros(v.shape, device=args.device), mesh, [Replicate(), Shard(0)]))
             for k, v in truth.items()}
    asked = [0]
    read_parts = Storage.read_parts

    def counted(self, name, start, parts):
        if name.startswith("data/"):
            asked[0] += sum(p.numel() for p in parts)
        return read_parts(self, name, start, parts)

    Storage.read_parts = counted
    dist.barrier()
    started = time.perf_counter()
    skc.load(state, args.url)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    Storage.read_parts = read_parts
    same = all(torch.equal((v.full_tensor() if hasattr(v, "full_tensor") else v).cpu(), truth[k])
               for k, v in state.items())
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "bitwise": same, "asked": asked[0],
                                      "seconds": seconds})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, else ``sys.argv``), checked; what ``main`` runs on."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="NCCL ranks, one GPU each: an even number >= 2")
    parser.add_argument("--mb", type=float, default=600.0, help="size of the saved tensors, MB")
    parser.add_argument("--dir", default="/tmp/shardkit-shared-reads-nccl")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: NCCL ranks, one GPU each; cpu: gloo ranks (a dry run of the script)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker and (args.ranks < 2 or args.ranks % 2):
        parser.error(f"--ranks must be an even number >= 2, got {args.ranks}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and gpus < args.ranks:
        print(f"skipped: {gpus} GPU(s), and NCCL between {args.ranks} ranks needs {args.ranks}")
        return
    import shardkit.checkpoint as skc

    shutil.rmtree(args.dir, ignore_errors=True)
    url = f"{args.dir}/ck"
    truth = _truth(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in truth.values())
    skc.save(truth, url)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           str(Path(__file__).resolve()), "--worker", f"--url={url}", f"--mb={args.mb}", f"--device={args.device}"]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # keep packages installed there
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    shutil.rmtree(args.dir, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        print(f"FIGURE NCCL shared reads, {args.ranks} ranks: load finished: no (exit {proc.returncode}) MISSED")
        raise SystemExit(f"the load failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    label = f"{'NCCL' if args.device == 'cuda' else 'gloo'} shared reads, {args.ranks} ranks"
    results = sorted(json.loads(lines[0].split(" ", 1)[1]), key=lambda r: r["rank"])
    asked = sum(r["asked"] for r in results)
    seconds = max(r["seconds"] for r in results)
    per_rank = ", ".join(f"rank {r['rank']}: {r['asked'] / 1e6:.0f} MB" for r in results)
    print(f"{args.ranks} {'NCCL' if args.device == 'cuda' else 'gloo'} ranks loaded {nbytes / 1e6:.0f} MB "
          f"(HSDP (2, {args.ranks // 2}) on {args.device}, one "
          f"host tensor on every rank) in {seconds:.2f} s; storage asked for {asked / 1e6:.0f} MB "
          f"({per_rank})")
    bitwise = all(r["bitwise"] for r in results)
    print(f"FIGURE {label}: every target bitwise: "
          f"{'yes' if bitwise else 'no'} {'MET' if bitwise else 'MISSED'}")
    ratio = asked / nbytes
    print(f"FIGURE {label}: bytes asked of storage / checkpoint: {ratio:.3f} "
          f"(<= 1.05) {'MET' if ratio <= 1.05 else 'MISSED'}")


if __name__ == "__main__":
    main()
