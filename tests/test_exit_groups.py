"""Programs that used shardkit exit cleanly: no gloo group of shardkit's is alive when the interpreter finalizes.

A gloo worker thread that frees a finished collective's work takes the GIL; if
it asks while the interpreter finalizes, CPython ends it inside a C++
destructor and the process aborts with ``terminate called without an active
exception`` after the program finished (see ``shardkit/held_groups.py``).  The
first two tests make that late free happen on purpose
(``exit_late_collective_run.py``): on a group the program kept alive, which
aborts -- the hazard, with torch alone -- and on ``async_save``'s own group,
which must not.  The last one launches the example's training with background
saves dozens of times, several at once, and wants every rank to exit 0.  The module-level soak does the
same with a script that keeps its model, optimizer and async, hot-tier ``CheckpointManager`` in module
globals (``exit_module_level_run.py``, launched by ``exit_soak.py``; ``benchmarks/exit_soak.py`` runs 100).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

SUPPORT = Path(__file__).resolve().parent / "support"
SOAK_LAUNCHES = 30
MODULE_LEVEL_LAUNCHES = 20
SOAK_AT_ONCE = 4  # launches running together (8 ranks on this machine's 2 cores): they load each other
# two steps, each saved in the background: the last save's commit is the run's last tensor collective.
# Written from a thread: a writer process per rank would import torch again (seconds of CPU each), and
# neither the groups nor the exit differ.
SOAK_TRAINING = ["--steps", "2", "--save-every", "1", "--dim", "16", "--layers", "1", "--heads", "2",
                 "--seq-len", "8", "--global-batch", "4", "--num-samples", "16", "--async-save",
                 "--writer", "thread"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **extra}


def _late_collective(out: Path, mode: str) -> tuple[list[int], str, dict]:
    """Run ``exit_late_collective_run.py`` on two ranks: (exit codes, rank 0's stderr, rank 0's report).

    This process hosts their store, as torchrun's agent does, on the port the kernel gives it: a port picked as
    free and bound later by rank 0 could be taken in between by another test's process."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ranks = [subprocess.Popen([sys.executable, str(SUPPORT / "exit_late_collective_run.py"), str(out), mode],
                              env=_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        errors = [rank.communicate(timeout=180)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()  # no-op for a rank that exited; ends a hung one
    return [rank.returncode for rank in ranks], errors[0], json.loads((out / "rank0.json").read_text())


def test_a_group_alive_when_the_interpreter_finalizes_aborts_the_exit_if_a_collective_on_it_ends_late(tmp_path):
    """The hazard itself, with torch alone: the group a module-level cache kept past destroy_process_group()."""
    codes, stderr, report = _late_collective(tmp_path, "kept")
    assert codes == [-signal.SIGABRT, 0], stderr[-3000:]
    assert "terminate called without an active exception" in stderr
    assert report == {"alive": 1}


def test_a_collective_ending_late_on_the_async_save_group_does_not_abort_the_exit(tmp_path):
    codes, stderr, report = _late_collective(tmp_path, "shardkit")
    assert codes == [0, 0], stderr[-3000:]
    assert "terminate called" not in stderr
    assert report == {"alive": 0}  # shardkit destroyed its group at exit, before the interpreter finalized


@pytest.mark.slow
def test_thirty_launches_of_the_example_training_with_background_saves_all_exit_cleanly(tmp_path):
    run = subprocess.run([sys.executable, str(SUPPORT / "exit_soak_run.py"), str(SOAK_LAUNCHES), str(SOAK_AT_ONCE),
                          str(tmp_path), *SOAK_TRAINING], env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["failed"] == [], report["failed"][:3]
    assert report["exit_codes"] == {"0": 2 * SOAK_LAUNCHES}
    committed = sorted(p.parent.parent.name for p in tmp_path.glob("launch*/step-0000000002/manifest.json"))
    assert committed == sorted(f"launch{i}" for i in range(SOAK_LAUNCHES))


def _module_level_soak(out: Path, *script_args: str) -> dict:
    run = subprocess.run([sys.executable, str(SUPPORT / "exit_soak.py"), str(MODULE_LEVEL_LAUNCHES), str(SOAK_AT_ONCE),
                          str(out), *script_args], env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_twenty_launches_of_a_module_level_script_with_async_hot_tier_saves_all_exit_cleanly(tmp_path):
    """Model, optimizer and CheckpointManager(async_save=True, local=...) are module globals, alive at exit."""
    report = _module_level_soak(tmp_path)
    assert report["failed"] == [], report["failed"][:3]
    assert report["exit_codes"] == {"0": 2 * MODULE_LEVEL_LAUNCHES}
    assert (report["aborts"], report["terminate_called"]) == (0, 0)
    assert report["last_step_committed"] == MODULE_LEVEL_LAUNCHES


def test_a_script_that_ends_during_its_last_background_save_still_commits_it(tmp_path):
    """No manager.wait(), no destroy_process_group(): the save in flight is finished before thread pools stop."""
    script = tmp_path / "ends_mid_save.py"
    script.write_text(
        "import threading, time\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from shardkit.held_groups import finish_before_exit\n"
        "pool = ThreadPoolExecutor(1)\n"
        "def save():\n"
        "    time.sleep(0.5)\n"
        "    with ThreadPoolExecutor(2) as inner:  # a save's parallel writes: refused once pools stopped\n"
        "        return sum(inner.map(abs, [-1, -2]))\n"
        "pending = pool.submit(save)\n"
        "finish_before_exit(pending.result)\n"
        "import atexit\n"
        "atexit.register(lambda: print('saved', pending.exception() or pending.result()))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "saved 3", run.stderr
