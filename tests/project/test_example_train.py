"""``examples/train.py`` (what ``make demo`` runs): trains under torchrun, saves,
and resumes on another number of ranks with the losses the first run printed."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from tests.support.dist import run_torchrun

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"
COMMON = ["--steps", "6", "--global-batch", "6"]


def test_train_example_saves_on_two_ranks_and_resumes_on_one_with_the_same_losses(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run_torchrun(EXAMPLE, 2, [*COMMON, "--checkpoint-dir", str(ckpt), "--save-every", "3",
                                      "--losses-out", str(tmp_path / "ws2.json")], timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    printed = [float(m) for m in re.findall(r"step\s+\d+/6\s+loss (\S+)", first.stdout)]
    assert len(printed) == 6 and all(math.isfinite(x) for x in printed), first.stdout
    assert printed[-1] < printed[0]
    assert "FSDPTinyLM" in first.stdout and "2 ranks" in first.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-0000000003", "step-0000000006"]

    resumed = run_torchrun(EXAMPLE, 1, [*COMMON, "--checkpoint-dir", str(ckpt), "--resume-step", "3",
                                        "--losses-out", str(tmp_path / "ws1.json")], timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed after step 3" in resumed.stdout
    reference = json.loads((tmp_path / "ws2.json").read_text())["losses"]
    after = json.loads((tmp_path / "ws1.json").read_text())
    assert after["start"] == 3 and len(after["losses"]) == 3
    for got, want in zip(after["losses"], reference[3:]):
        assert abs(got - want) <= 1e-6 * abs(want), (after["losses"], reference[3:])
