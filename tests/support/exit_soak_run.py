"""Launch ``examples/train.py``'s training many times, two gloo ranks a launch, each rank exiting like any program.

    exit_soak_run.py LAUNCHES AT_ONCE OUT [train.py arguments...]

Why not torchrun: every process that imports torch spends seconds of CPU on
it, and a soak of dozens of launches would spend minutes on imports alone.
This launcher imports torch (``torch._dynamo`` too, which each rank's first
DTensor would import), shardkit and ``examples/train.py`` once and forks every
rank from itself (before any thread runs in it, which it checks; the tests set
``OPENBLAS_NUM_THREADS=1`` so that numpy starts none).  Each
rank gets the environment torchrun gives a worker (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of a store hosted for the launch as torchrun's agent hosts it),
writes its output to ``OUT/launch<i>-rank<r>.log``, runs ``train.main`` with
``--checkpoint-dir OUT/launch<i>`` added, and leaves through the interpreter's
normal exit -- the program's threads joined, exit functions, finalization --
which is where an exit-time abort happens.  The inherited heap is frozen
(``gc.freeze``) before the first fork, so that no rank's collector walks it.  ``AT_ONCE`` launches run at the
same time, so they load each other as on a busy machine.

Prints one JSON line: ``{"launches": n, "exit_codes": {code: ranks}, "failed": [{"launch", "rank", "code",
"log"}]}`` (a rank that outlives ``RANK_TIMEOUT_S`` is killed and counted with code ``"timeout"``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch  # noqa: F401 - imported once here, inherited by every forked rank
import torch._dynamo  # noqa: F401 - likewise: every rank's first DTensor would import it (two seconds of CPU)

import shardkit.checkpoint.training.manager  # noqa: F401 - likewise

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: the repository's tests package, for the shared launch loop
from tests.support.exit_soak import RANKS, fork_launches  # noqa: E402


def load_train_module():
    spec = importlib.util.spec_from_file_location("shardkit_example_train", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_rank(train, launch: int, rank: int, port: int, out: Path, train_args: list[str]) -> None:
    """In the forked child: become rank ``rank`` of launch ``launch``, train, and exit normally."""
    log = os.open(out / f"launch{launch}-rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_WORLD_SIZE=str(RANKS),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    train.main([*train_args, "--checkpoint-dir", str(out / f"launch{launch}")])
    raise SystemExit(0)  # up through the launcher's frames: the interpreter's own exit, finalization included


def soak(launches: int, at_once: int, out: Path, train_args: list[str]) -> dict:
    train = load_train_module()
    codes, failed = fork_launches(launches, at_once, out, lambda launch, rank, port: run_rank(
        train, launch, rank, port, out, train_args))
    return {"launches": launches, "exit_codes": codes, "failed": failed}


def main(argv: list[str]) -> None:
    launches, at_once, out = int(argv[0]), int(argv[1]), Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(soak(launches, at_once, out, argv[3:])), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
