"""ShardkitCheckpointManager in torchtitan's training loop on 2 CPU gloo ranks: stop, resume, bitwise.

torchtitan 0.3's trainer cannot start on a CPU-only torch (see
tests/support/torchtitan_seam.py for the two lines that refuse), so the loop is
the trainer's own pieces, built and stepped as ``Trainer`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer")

from shardkit.checkpoint.formats import open_reader  # noqa: E402
from shardkit.integrations.torchtitan.steps import format_of  # noqa: E402
from tests.support import torchtitan_ranks as ranks  # noqa: E402
from tests.support.dist import run_on_ranks, run_torchrun  # noqa: E402
from tests.support.torchtitan_seam import PrefixAdapter  # noqa: E402


def _verify(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardkit", "verify", path], capture_output=True, text=True,
                          timeout=120)


def test_a_job_stopped_after_step_3_resumes_step_2_and_reproduces_every_later_loss_bitwise(tmp_path):
    per_rank = run_on_ranks(2, ranks.stop_and_resume, str(tmp_path), 3)
    for out in per_rank:
        assert out["resumed"] == out["full"][2:]  # step 2 was the last save: steps 3..6 again, bit for bit
        assert out["listing"] == ["step-2", "step-4", "step-6"]
    for step in (2, 4, 6):
        result = _verify(str(tmp_path / "run" / "ckpt" / f"step-{step}"))
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_saves_resume_bitwise_and_leave_nothing_staging(tmp_path, mode):
    per_rank = run_on_ranks(2, ranks.stop_and_resume, str(tmp_path), 5, async_mode=mode)
    for out in per_rank:
        assert out["resumed"] == out["full"][4:]
        assert out["staging"] is None  # maybe_wait_for_staging cleared it
        assert out["listing"] == ["step-2", "step-4", "step-6"]
    assert _verify(str(tmp_path / "run" / "ckpt" / "step-4")).returncode == 0


def test_a_2_rank_step_resumes_on_1_rank_within_1e_6(tmp_path):
    full = run_on_ranks(2, ranks.save_at_two, str(tmp_path))[0]
    step, alone = run_on_ranks(1, ranks.resume_alone, str(tmp_path), 4)[0]
    assert step == 4 and len(alone) == 2
    assert torch.allclose(torch.tensor(alone, dtype=torch.float64), torch.tensor(full[4:], dtype=torch.float64),
                          rtol=0, atol=1e-6)


def test_a_crashed_save_is_never_resumed_and_goes_with_retention(tmp_path):
    per_rank = run_on_ranks(2, ranks.crash_leftovers, str(tmp_path))
    for out in per_rank:
        assert out["restored"] == 4  # not 6 (shardkit data, no manifest) nor 8 (DCP shards, no .metadata)
        assert out["resumed"] == out["full"][4:]
    # steps 5 and 6 committed over the leftovers (6 saved again, whole); retention kept the newest 2
    # the step-8 leftover lies above every commit (it could be a save in flight) and stays
    assert per_rank[0]["listing"] == ["step-4", "step-6", "step-8"]
    assert _verify(str(tmp_path / "run" / "ckpt" / "step-6")).returncode == 0


def test_a_save_killed_half_way_by_sigkill_is_never_resumed(tmp_path):
    script = Path(__file__).resolve().parents[1] / "support" / "torchtitan_crash_run.py"
    results = {}
    for phase in ("full", "crash", "resume"):
        done = run_torchrun(script, 2, [str(tmp_path), phase, str(tmp_path / f"{phase}.json")], timeout=300)
        assert (done.returncode != 0) == (phase == "crash"), done.stderr[-3000:]
        if phase == "crash":
            step_6 = tmp_path / "run" / "ckpt" / "step-6"
            assert os.listdir(step_6 / "data") and format_of(str(step_6)) is None  # data, no commit
        else:
            results[phase] = json.loads((tmp_path / f"{phase}.json").read_text())
    assert results["resume"]["restored_from"] == 4
    assert results["resume"]["losses"] == results["full"]["losses"][4:]
    assert _verify(str(tmp_path / "run" / "ckpt" / "step-6")).returncode == 0  # saved again, whole


def test_load_step_resumes_the_step_asked_for_not_the_newest(tmp_path):
    for out in run_on_ranks(2, ranks.load_step_honoured, str(tmp_path)):
        assert out["resumed"] == out["full"][2:]


@pytest.mark.parametrize("with_dataloader", [False, True])
def test_torchtitans_own_dcp_step_resumes_bitwise_and_the_run_goes_on_in_shardkit_steps(tmp_path, with_dataloader):
    for out in run_on_ranks(2, ranks.dcp_then_shardkit, str(tmp_path), with_dataloader):
        assert out["resumed"] == out["full"][2:]
    folder = tmp_path / "run" / "ckpt"
    assert _verify(str(folder / "step-2")).returncode == 0  # DCP, written by torchtitan's manager
    assert _verify(str(folder / "step-4")).returncode == 0  # shardkit, written after the resume


def test_the_last_step_saves_the_model_alone_in_export_dtype_and_it_starts_a_new_run(tmp_path):
    weights = run_on_ranks(2, ranks.final_exports, str(tmp_path))[0]
    last = str(tmp_path / "run" / "ckpt" / "step-6")
    reader = open_reader(last)
    try:
        stored = reader.tensors()
        assert set(stored) == {f"model.{k}" for k in weights}
        assert {e.dtype for e in stored.values()} == {torch.bfloat16}
        assert reader.info.meta["model_only"] is True
    finally:
        reader.close()
    assert _verify(last).returncode == 0
    for out in run_on_ranks(2, ranks.initial_load, str(tmp_path), last, True):
        assert out["loaded"] and out["step"] == 0
        assert all(torch.equal(out["weights"][k].to(torch.bfloat16), w) for k, w in weights.items())


def test_last_save_in_hf_writes_a_hugging_face_folder_that_initial_load_in_hf_reads(tmp_path):
    weights = run_on_ranks(2, ranks.final_exports, str(tmp_path), PrefixAdapter())[0]
    last = tmp_path / "run" / "ckpt" / "step-6"
    assert "model.safetensors" in os.listdir(last)
    assert not [n for n in os.listdir(last.parent) if n.startswith(".")]  # the intermediate is gone
    from safetensors.torch import load_file

    stored = load_file(str(last / "model.safetensors"))
    assert set(stored) == {f"model.{k}" for k in weights}
    assert all(torch.equal(stored[f"model.{k}"], w) for k, w in weights.items())
    assert _verify(str(last)).returncode == 0
    for out in run_on_ranks(2, ranks.initial_load, str(tmp_path), str(last), True, PrefixAdapter()):
        assert out["loaded"] and out["step"] == 0
        assert all(torch.equal(out["weights"][k].to(torch.bfloat16), w) for k, w in weights.items())


def test_initial_load_path_full_state_restores_optimizer_too(tmp_path):
    run_on_ranks(2, ranks.save_at_two, str(tmp_path))
    step_4 = str(tmp_path / "run" / "ckpt" / "step-4")
    only_model, everything = (run_on_ranks(2, ranks.initial_load, str(tmp_path), step_4, m)[0] for m in (True, False))
    assert only_model["step"] == 0 and everything["step"] == 4
    assert all(torch.equal(only_model["weights"][k], everything["weights"][k]) for k in everything["weights"])
    assert everything["optimizer_state"] > 0


def test_keep_latest_k_keeps_the_newest_steps(tmp_path):
    out = run_on_ranks(2, ranks.retention, str(tmp_path))
    assert out[0]["listing"] == ["step-5", "step-6"]
