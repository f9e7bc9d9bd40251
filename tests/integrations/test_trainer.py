"""``use_shardkit()`` makes shardkit the engine of the Hugging Face Trainer's FSDP2 checkpoints:
``Trainer.train()`` with ``save_steps`` writes ``checkpoint-N/`` through shardkit beside the Trainer's own RNG,
scheduler and state files, ``Trainer.train(resume_from_checkpoint=True)`` in new processes continues with the
uninterrupted run's losses bitwise, and ``save_total_limit`` still rotates.

The Trainer runs under torchrun on 2 gloo ranks (``tests/support/accelerate_shardkit_trainer_run.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from shardkit.integrations.accelerate.engine import holds_shardkit  # noqa: E402
from tests.support.dist import run_torchrun  # noqa: E402
from tests.support.framework_helpers import FRAMEWORK_MODULE_TIMEOUT, FRAMEWORK_RUN_S  # noqa: E402
from tests.support.offline_cli import run_cli  # noqa: E402

pytestmark = [pytest.mark.slow, FRAMEWORK_MODULE_TIMEOUT]

SCRIPT = Path(__file__).parents[1] / "support" / "accelerate_shardkit_trainer_run.py"


def _launch(*args: str) -> None:
    done = run_torchrun(SCRIPT, 2, list(args), timeout=FRAMEWORK_RUN_S)
    assert done.returncode == 0, f"{SCRIPT.name} {args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The uninterrupted run and one stopped after its first checkpoint, then that one resumed (about 25 s)."""
    out = tmp_path_factory.mktemp("trainer-shardkit")
    _launch("write", str(out))
    _launch("resume", str(out))
    return out


def _losses(runs: Path, name: str) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in json.loads((runs / f"{name}.log.json").read_text()) if "loss" in h}


def test_save_steps_write_checkpoint_n_through_shardkit_beside_the_trainers_own_files(runs):
    checkpoint = runs / "stopped" / "checkpoint-2"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "optimizer_0", "pytorch_model_fsdp_0", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt",
        "trainer_state.json"]
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert holds_shardkit(str(checkpoint / part))
        checked = run_cli("verify", str(checkpoint / part))
        assert checked.exit_code == 0, checked.stderr
    assert run_cli("verify", str(checkpoint)).exit_code == 0


def test_resume_from_checkpoint_true_continues_with_the_uninterrupted_losses_bitwise(runs):
    whole, stopped, resumed = _losses(runs, "whole"), _losses(runs, "stopped"), _losses(runs, "stopped-resumed")
    assert sorted(stopped) == [1, 2]  # the job died at its first save
    assert sorted(whole) == sorted(resumed) == [1, 2, 3, 4]
    assert resumed == whole  # steps 1-2 from trainer_state.json, 3-4 trained after the load


def test_save_total_limit_still_rotates_shardkit_checkpoints(runs):
    kept = sorted((runs / "whole").glob("checkpoint-*"))
    assert [p.name for p in kept] == ["checkpoint-3", "checkpoint-4"]
    assert all(holds_shardkit(str(p / "optimizer_0")) for p in kept)
