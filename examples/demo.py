"""The end-to-end demo behind ``make demo``: train, save, inspect, resume elsewhere.

1. Train a small transformer with ``shardkit.fully_shard`` on 2 ranks (torchrun,
   gloo on CPU) for 10 steps, saving model + AdamW state after steps 5 and 10.
2. Look at the step-5 checkpoint with the CLI: ``shardkit inspect`` and
   ``shardkit verify`` (every checksum, full coverage).
3. Resume step 5's checkpoint on 1 rank and on 3 ranks, and reshard it offline
   to 3 ranks (``shardkit reshard``), and compare each resumed run's losses and
   batches with the 2-rank run's steps 6-10: the data position (an
   ``ElasticSampler``'s global position) and the RNG come with the checkpoint,
   so each resumed run sees the same samples in the same global batches.

Everything is written under ``out/demo`` (local disk).  Exits non-zero if a
resumed run does not see the original batches or reproduce the original losses (fp32, relative 1e-6).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out" / "demo"
TRAIN = ROOT / "examples" / "train.py"
COMMON = ["--steps", "10", "--global-batch", "12", "--seed", "0"]
TOLERANCE = 1e-6


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(str(c) for c in cmd).replace(sys.executable, "python"), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([str(c) for c in cmd], check=True, env=env, cwd=ROOT)


def torchrun(nproc: int, *args: str) -> None:
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         TRAIN, *COMMON, *args])


def shardkit(*args: str) -> None:
    run([sys.executable, "-m", "shardkit", *args])


def losses(path: Path) -> dict:
    return json.loads(path.read_text())


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    ckpt = OUT / "ckpt"
    step5 = ckpt / "step-0000000005"

    banner("1. train 10 steps on 2 ranks, saving after steps 5 and 10")
    torchrun(2, "--checkpoint-dir", str(ckpt), "--save-every", "5", "--losses-out", str(OUT / "ws2.json"))

    banner("2. inspect and verify the step-5 checkpoint")
    shardkit("inspect", str(step5))
    shardkit("verify", str(step5))

    banner("3a. resume step 5 on 1 rank")
    torchrun(1, "--checkpoint-dir", str(ckpt), "--resume-step", "5", "--losses-out", str(OUT / "ws1.json"))
    banner("3b. resume step 5 on 3 ranks")
    torchrun(3, "--checkpoint-dir", str(ckpt), "--resume-step", "5", "--losses-out", str(OUT / "ws3.json"))
    banner("3c. reshard step 5 offline for 3 ranks, then resume from that copy on 3 ranks")
    resharded = OUT / "resharded"
    shardkit("reshard", str(step5), str(resharded / "step-0000000005"), "--world-size", "3")
    torchrun(3, "--checkpoint-dir", str(resharded), "--resume-step", "5",
             "--losses-out", str(OUT / "ws3_offline.json"))

    banner("resumed losses against the uninterrupted 2-rank run")
    uninterrupted = losses(OUT / "ws2.json")
    reference = uninterrupted["losses"]
    runs = {name: losses(OUT / f"{name}.json") for name in ("ws1", "ws3", "ws3_offline")}
    same_batches = all(run["batches"] == uninterrupted["batches"][run["start"]:] for run in runs.values())
    labels = {"ws1": "1 rank", "ws3": "3 ranks", "ws3_offline": "3 ranks (offline reshard)"}
    print(f"{'step':>4}  {'2 ranks':>10}  " + "  ".join(f"{labels[n]:>26}" for n in runs))
    worst = 0.0
    for step in range(5, 10):
        cells = []
        for run_losses in runs.values():
            value = run_losses["losses"][step - run_losses["start"]]
            worst = max(worst, abs(value - reference[step]) / abs(reference[step]))
            cells.append(f"{value:>26.7f}")
        print(f"{step + 1:>4}  {reference[step]:>10.7f}  " + "  ".join(cells))
    ok = worst <= TOLERANCE and same_batches
    print(f"\nglobal batches of every resumed step: "
          f"{'the same samples as the uninterrupted run' if same_batches else 'MISMATCH'}")
    print(f"largest relative difference: {worst:.2e} (tolerance {TOLERANCE:g}) -> "
          f"{'resumed losses match' if worst <= TOLERANCE else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
