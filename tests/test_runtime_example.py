"""``examples/train.py`` (what ``make demo`` runs) trains under torchrun."""

from __future__ import annotations

import math
import re
from pathlib import Path

from tests.dist import run_torchrun

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def test_train_example_runs_on_two_ranks_and_the_loss_falls():
    result = run_torchrun(EXAMPLE, 2, ["--steps", "4"], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"step\s+\d+/4\s+loss (\S+)", result.stdout)]
    assert len(losses) == 4, result.stdout
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert "FSDPTinyLM" in result.stdout and "2 ranks" in result.stdout
