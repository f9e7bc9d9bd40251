"""Each framework's checkpoint save and resume with its default engine and with shardkit, same run, same state.

For every framework with a runner in ``benchmarks/integration_runs/`` (Lightning's
``ModelParallelStrategy`` vs ``ShardkitStrategy``; Accelerate's ``save_state`` /
``load_state`` with and without ``use_shardkit()``; torchtitan's DCP
``CheckpointManager`` vs ``ShardkitCheckpointManager``) each round times both
engines, in an order that rotates from round to round, on 2 gloo ranks through
the framework's own entry point.  A runner's ``measure(engine, workdir)``
returns the save call's and the resume's seconds, the slowest rank's, measured
inside the ranks (process start-up and model building are not checkpointing).

Reported: medians over ``--rounds``, the ratio shardkit / default, and
MET/MISSED against issue 39's targets: save <= 1.0x the default's, resume
<= 0.8x the default's.

    python benchmarks/integrations.py --rounds 5 [--only lightning,accelerate,torchtitan]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

RUNNERS = Path(__file__).resolve().parent / "integration_runs"
ENGINES = ("default", "shardkit")
TARGETS = {"save_s": 1.0, "resume_s": 0.8}

sys.path.insert(0, str(RUNNERS.parents[1]))


def load_runner(name: str):
    """The runner module ``integration_runs/<name>.py`` (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"integration_runs_{name}", RUNNERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def available() -> list[str]:
    return sorted(p.stem for p in RUNNERS.glob("*.py") if not p.stem.startswith("_"))


def verdict(ratio: float, target: float) -> str:
    return "MET" if ratio <= target else "MISSED"


def run(frameworks: list[str], rounds: int, root: str) -> dict[str, dict[str, dict[str, list[float]]]]:
    """{framework: {engine: {"save_s": [...], "resume_s": [...]}}}, every engine timed in every round."""
    runners = {name: load_runner(name) for name in frameworks}
    times = {name: {e: {k: [] for k in TARGETS} for e in ENGINES} for name in frameworks}
    for r in range(rounds):
        for name, runner in runners.items():
            order = ENGINES if r % 2 == 0 else tuple(reversed(ENGINES))
            for engine in order:
                workdir = tempfile.mkdtemp(prefix=f"{name}-{engine}-", dir=root)
                try:
                    result = runner.measure(engine, workdir)
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
                for key in TARGETS:
                    times[name][engine][key].append(float(result[key]))
                print(f"round {r + 1}/{rounds} {name:<11} {engine:<9} save {result['save_s']:.3f} s"
                      f"  resume {result['resume_s']:.3f} s", flush=True)
    return times


def report(times: dict[str, dict[str, dict[str, list[float]]]]) -> list[str]:
    lines = [f"{'framework':<11} {'op':<7} {'default':>9} {'shardkit':>9} {'ratio':>7} {'target':>7}  verdict"]
    for name, engines in times.items():
        for key, target in TARGETS.items():
            default = statistics.median(engines["default"][key])
            ours = statistics.median(engines["shardkit"][key])
            ratio = ours / default if default > 0 else float("inf")
            lines.append(f"{name:<11} {key[:-2]:<7} {default:>8.3f}s {ours:>8.3f}s {ratio:>6.2f}x {target:>6.1f}x"
                         f"  {verdict(ratio, target)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default=",".join(available()), help="comma-separated frameworks")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a local disk)")
    args = parser.parse_args()
    frameworks = [f for f in args.only.split(",") if f]
    unknown = sorted(set(frameworks) - set(available()))
    if unknown:
        raise SystemExit(f"no runner for {', '.join(unknown)}: have {', '.join(available())}")
    root = args.dir or tempfile.mkdtemp(prefix="shardkit-integrations-")
    os.makedirs(root, exist_ok=True)
    times = run(frameworks, args.rounds, root)
    print(f"\nmedians of {args.rounds} interleaved rounds, 2 gloo ranks, {root}")
    print("\n".join(report(times)))


if __name__ == "__main__":
    main()
