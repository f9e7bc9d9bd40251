"""A DeepSpeed ZeRO checkpoint to Hugging Face safetensors: shardkit vs DeepSpeed's own zero_to_fp32.

The checkpoint is written by the real DeepSpeed (``tests/support/deepspeed_run.py``:
2 gloo ranks on CPU, ZeRO stage 2, a Llama whose embedding and lm_head are
ROWS x 1024 fp32, one AdamW step), so it holds ROWS * 8 KiB of fp32 weights
in the flat master partitions, twice that in Adam moments, and the module's
own copy in ``mp_rank_00_model_states.pt``.

Each round runs, each in a fresh process (so peak RSS is the tool's own) with
the page cache dropped first where the machine allows it (``reshard.py``'s
``timed``), interleaved round by round, medians reported:

* DeepSpeed: ``convert_zero_checkpoint_to_fp32_state_dict(SRC, OUT,
  safe_serialization=True)``, the function behind its ``zero_to_fp32.py``;
* shardkit: ``shardkit convert SRC OUT --to hf --max-memory BUDGET``.

Both write the fp32 weights as safetensors shards; the outputs are compared
bitwise once.  Figures: wall seconds of the process (interpreter and imports
included) and peak RSS (VmHWM).  Targets: shardkit's peak RSS <= BUDGET +
256 MiB whatever the checkpoint size, and its time <= DeepSpeed's.

    python benchmarks/deepspeed_convert.py --rows 131072 --dir /tmp/ds-bench --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEPSPEED_RUN = os.path.join(ROOT, "tests", "support", "deepspeed_run.py")
sys.path.insert(0, ROOT)

from benchmarks.reshard import timed  # noqa: E402

MiB = 1 << 20


def write_fixture(root: str, rows: int) -> str:
    src = os.path.join(root, "big")
    if not os.path.exists(os.path.join(src, "latest")):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               DEEPSPEED_RUN, root, "--only-big", "--big-embedding",
                               str(rows)], env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"writing the DeepSpeed checkpoint failed:\n{done.stderr[-3000:]}")
    return src


def same_weights(a: str, b: str) -> bool:
    from safetensors import safe_open

    def tensors(folder: str) -> dict:
        out = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(folder, name), "pt") as f:
                    out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    x, y = tensors(a), tensors(b)
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and bool((x[k] == y[k]).all()) for k in x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=131072, help="embedding rows (x 1024 fp32, twice: embed + head)")
    parser.add_argument("--dir", default="/tmp/shardkit-ds-bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", default="256MiB")
    args = parser.parse_args()
    src = write_fixture(args.dir, args.rows)
    data = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(src) for f in fs)
    weights = 2 * args.rows * 1024 * 4
    print(f"checkpoint: {src}, {data / 2**30:.2f} GiB on disk, {weights / 2**30:.2f} GiB of fp32 embedding/head "
          f"weights; {args.rounds} interleaved rounds, fresh process each")
    ds_out, sk_out = os.path.join(args.dir, "out-deepspeed"), os.path.join(args.dir, "out-shardkit")
    ds_cmd = [sys.executable, "-c", "import sys; from deepspeed.utils.zero_to_fp32 import "
              "convert_zero_checkpoint_to_fp32_state_dict as c; c(sys.argv[1], sys.argv[2], safe_serialization=True)",
              src, ds_out]
    sk_cmd = [sys.executable, "-m", "shardkit", "-q", "convert", src, sk_out, "--to", "hf", "--max-memory",
              args.budget, "--overwrite"]
    os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's import picks its CPU accelerator
    runs: dict[str, list[tuple[float, int]]] = {"deepspeed": [], "shardkit": []}
    for _ in range(args.rounds):
        shutil.rmtree(ds_out, ignore_errors=True)
        for name, cmd in (("deepspeed", ds_cmd), ("shardkit", sk_cmd)):
            wall, _, peak = timed(cmd)  # a fresh process each, the page cache dropped first where allowed
            runs[name].append((wall, peak))
    print(f"outputs bitwise equal: {same_weights(ds_out, sk_out)}")

    def med(name: str, i: int) -> float:
        return statistics.median(r[i] for r in runs[name])

    for name in runs:
        print(f"  {name:10s} {med(name, 0):7.2f} s   peak RSS {med(name, 1) / MiB:8.0f} MiB   "
              f"(rounds: {', '.join(f'{s:.2f}s/{m / MiB:.0f}MiB' for s, m in runs[name])})")
    from shardkit.checkpoint.offline.options import parse_memory

    limit = parse_memory(args.budget) + 256 * MiB
    rss, secs = med("shardkit", 1), med("shardkit", 0) / med("deepspeed", 0)
    print(f"  peak RSS shardkit/deepspeed {med('shardkit', 1) / med('deepspeed', 1):.3f}; shardkit "
          f"{rss / MiB:.0f} MiB <= budget + 256 MiB = {limit / MiB:.0f} MiB  {'MET' if rss <= limit else 'MISSED'}")
    print(f"  time shardkit/deepspeed {secs:.3f} (<= 1.0)  {'MET' if secs <= 1.0 else 'MISSED'}")


if __name__ == "__main__":
    main()
