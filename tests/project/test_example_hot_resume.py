"""``examples/hot_resume.py`` under ``torchrun --max-restarts 1``: a node lost after step 6 (its directory
wiped, one of its ranks killed) and the restarted job resumes step 6 from the replicas on the other node,
then trains on with the losses of a run that was never interrupted, bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.dist import run_torchrun

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hot_resume.py"
STEPS, DIE_AT = 7, 6

# torchrun shares its rendezvous store with the workers by default, and a restarted worker's gloo group
# then reads the previous attempt's addresses from it and cannot connect; torch's own opt-out gives every
# attempt a store of its own (docs/checkpoint.md, "Recovering in seconds").
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _run_example(root: Path, out: Path, *args: str) -> tuple[dict, str]:
    done = run_torchrun(EXAMPLE, 4, ["--root", str(root), "--steps", str(STEPS), "--out", str(out), *args],
                        launcher_args=["--max-restarts", "1"], env=RESTARTABLE, timeout=420)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(out.read_text()), done.stdout


def test_a_lost_node_resumes_from_its_peer_copy_with_the_losses_of_the_uninterrupted_run(tmp_path):
    reference, _ = _run_example(tmp_path / "uninterrupted", tmp_path / "uninterrupted.json")
    assert (reference["attempt"], reference["resumed"], reference["steps"]) == (0, None, list(range(1, STEPS + 1)))

    got, printed = _run_example(tmp_path / "lost", tmp_path / "lost.json", "--die-at", str(DIE_AT))
    assert f"rank 2: node 1 lost after step {DIE_AT} (its directory wiped)" in printed
    assert got["attempt"] == 1  # the job ran twice: torchrun restarted every worker once
    assert (got["resumed"]["step"], got["resumed"]["source"]) == (DIE_AT, "peer")
    assert f"attempt 1: resumed after step {DIE_AT} from the peer tier in " in printed
    assert got["steps"] == list(range(DIE_AT + 1, STEPS + 1))
    assert got["losses"] == reference["losses"][DIE_AT:]  # bitwise: the same floats, through JSON's repr
    # the replaced node holds the steps saved since the restart, nothing of the lost one
    [run] = os.listdir(tmp_path / "lost" / "hot" / "node1")  # run-<digest of the durable root>
    assert sorted(os.listdir(tmp_path / "lost" / "hot" / "node1" / run)) == ["root.json", f"step-{STEPS:010d}"]
