"""``shardkit reshard SRC DST --overwrite`` killed at random moments never loses DST.

After every SIGKILL, DST is either the old checkpoint or the new one, whole:
``verify`` passes and ``diff`` finds it bitwise equal to one of the two
sources.  The replacement is written beside the old checkpoint and committed by
one atomic manifest replace, so there is no moment at which DST is neither.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardkit.checkpoint import diff, reshard, verify
from tests.support.offline_helpers import write_torch_state

pytestmark = pytest.mark.slow

TRIALS = 4  # each trial kills at a uniformly random moment of the write; the seed spreads them over it


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.w": torch.randn(1024, 1024, generator=gen) for i in range(12)}  # 48 MiB


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _reshard_command(src: Path, dst: Path) -> list[str]:
    return [sys.executable, "-m", "shardkit", "-q", "reshard", str(src), str(dst), "--world-size", "3",
            "--overwrite", "--workers", "2"]


def _start_and_wait_for_writing(command: list[str], dst: Path, clean: set[str], env: dict) -> subprocess.Popen:
    """Start ``command`` and return once it has begun writing into ``dst`` (or has exited)."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while proc.poll() is None and _listing(dst) == clean and time.monotonic() < deadline:
        time.sleep(0.002)
    return proc


def test_killing_a_reshard_with_overwrite_at_random_moments_never_loses_dst(tmp_path):
    old_src = write_torch_state(tmp_path / "old.pt", _weights(1), [])
    new_src = write_torch_state(tmp_path / "new.pt", _weights(2), [])
    dst = tmp_path / "dst"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def reset_to_old() -> set[str]:
        reshard(str(old_src), str(dst), world_size=2, overwrite=True)
        return _listing(dst)

    clean = reset_to_old()
    proc = _start_and_wait_for_writing(_reshard_command(new_src, dst), dst, clean, env)
    started = time.monotonic()
    assert proc.wait(timeout=120) == 0
    writing = time.monotonic() - started  # how long the run writes, from its first file to its exit
    assert diff(str(new_src), str(dst)).equal
    reset_to_old()

    rng = random.Random(8)
    outcomes = {"old": 0, "new": 0}
    killed_while_writing = 0
    for _ in range(TRIALS):
        before = _listing(dst)  # the old checkpoint, plus what an earlier killed run left for this one to resume
        proc = _start_and_wait_for_writing(_reshard_command(new_src, dst), dst, before, env)
        time.sleep(rng.uniform(0, writing))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        killed_while_writing += proc.returncode == -signal.SIGKILL
        report = verify(str(dst))
        assert report.ok, report.problems
        state = "old" if diff(str(old_src), str(dst)).equal else "new"
        assert state == "old" or diff(str(new_src), str(dst)).equal
        outcomes[state] += 1
        if state == "new":
            reset_to_old()
    assert killed_while_writing >= TRIALS // 2, (killed_while_writing, outcomes, writing)
