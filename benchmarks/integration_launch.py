"""What every runner of ``benchmarks/integration_runs/`` shares: the torchrun launch, the slowest rank's time,
the result file, and running a runner as a script.

A runner is loaded by path (``benchmarks/integrations.py``) and run as a
script on each rank under torchrun, where its own folder leads ``sys.path``
and its name (``lightning.py``, ``accelerate.py``, ``torchtitan.py``) would
hide the framework it measures: :func:`run_as_script` takes that folder off
the path first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

ENGINES = ("default", "shardkit")
RUN_TIMEOUT_S = 900
RESULT = "result.json"


def launch(runner: str, framework: str, engine: str, workdir: str, nproc: int = 2) -> dict:
    """Run ``runner`` (a file) on ``nproc`` gloo ranks under torchrun as ``runner ENGINE WORKDIR``; the dict
    its rank 0 wrote with :func:`write_result`."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: use one of {ENGINES}")
    os.makedirs(workdir, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               os.path.abspath(runner), engine, workdir]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"the {framework} {engine} run failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-4000:]}")
    with open(os.path.join(workdir, RESULT)) as f:
        return json.load(f)


def slowest_rank_seconds(call: Callable[[], object]) -> float:
    """Seconds ``call()`` took on the slowest rank: a barrier before, the maximum over ranks after."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    call()
    took = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def write_result(workdir: str, result: dict) -> None:
    """Rank 0 writes ``result`` for :func:`launch`; every rank waits for it, then leaves the process group."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(os.path.join(workdir, RESULT), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_as_script(runner: str, on_rank: Callable[[str, str], None], measure: Callable[[str, str], dict]) -> None:
    """``runner ENGINE WORKDIR`` (on a rank, under torchrun): ``on_rank``; bare: one measurement per engine."""
    here = os.path.dirname(os.path.abspath(runner))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    if len(sys.argv) == 3:
        on_rank(sys.argv[1], sys.argv[2])
        return
    for engine in ENGINES:
        with tempfile.TemporaryDirectory(prefix=f"{engine}-") as workdir:
            print(engine, measure(engine, workdir))
