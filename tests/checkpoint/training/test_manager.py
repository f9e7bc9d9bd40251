"""CheckpointManager and the rule of trust: it deletes only what it wrote, and never resumes silently from nothing."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import shardkit.checkpoint as skc
import shardkit.checkpoint.training.retention as retention_module
from shardkit.checkpoint.training.manager import step_dir
from shardkit.errors import CheckpointNotFound
from tests.support.checkpoint_helpers import build_model


def _tree_digest(path: Path) -> dict[str, str]:
    """Every file under ``path`` with the sha256 of its bytes: equal digests mean nothing was touched."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _foreign_steps(root: Path) -> dict[str, Path]:
    """A torch DCP checkpoint as ``step-4`` and a Hugging Face export as ``step-5`` under ``root``."""
    dcp_dir = root / step_dir(4)
    dcp.save({"w": torch.arange(12.0).reshape(3, 4)}, checkpoint_id=str(dcp_dir), no_dist=True)
    hf_dir = root / step_dir(5)
    hf_dir.mkdir(parents=True)
    save_file({"lm_head.weight": torch.ones(2, 3)}, str(hf_dir / "model.safetensors"))
    (hf_dir / "config.json").write_text('{"model_type": "gpt2"}')
    return {"dcp": dcp_dir, "hf": hf_dir}


def _warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


@pytest.mark.parametrize("keep_last", [None, 1], ids=["keep-all", "keep-last-1"])
def test_manager_never_deletes_a_step_directory_it_did_not_write(tmp_path, caplog, keep_last):
    root = tmp_path / "run"
    foreign = _foreign_steps(root)
    before = {kind: _tree_digest(path) for kind, path in foreign.items()}
    manager = skc.CheckpointManager(str(root), keep_last=keep_last)
    model = build_model("plain", seed=1)
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        manager.save(6, model)
        manager.save(7, model)
    assert {kind: _tree_digest(path) for kind, path in foreign.items()} == before
    assert manager.steps() == ([6, 7] if keep_last is None else [7])
    said = _warnings(caplog)
    assert f"{step_dir(4)} (a torch.distributed.checkpoint directory, not a shardkit checkpoint)" in said
    assert f"{step_dir(5)} (a Hugging Face safetensors file or folder, not a shardkit checkpoint)" in said


def test_an_interrupted_shardkit_save_is_swept_but_one_holding_a_users_file_is_kept(tmp_path):
    root = tmp_path / "run"
    interrupted = root / step_dir(1) / "data"
    interrupted.mkdir(parents=True)
    (interrupted / "0123456789-0-0.safetensors").write_bytes(b"half an upload")
    mixed = root / step_dir(2)
    (mixed / "data").mkdir(parents=True)
    (mixed / "data" / "0123456789-0-0.safetensors").write_bytes(b"half an upload")
    (mixed / "notes.txt").write_text("mine")
    skc.CheckpointManager(str(root)).save(3, build_model("plain", seed=1))
    assert not (root / step_dir(1)).exists()
    assert (mixed / "notes.txt").read_text() == "mine"
    assert (mixed / "data" / "0123456789-0-0.safetensors").exists()


def test_retention_removes_only_shardkit_files_from_a_step_that_also_holds_a_users_file(tmp_path):
    root = tmp_path / "run"
    manager = skc.CheckpointManager(str(root), keep_last=1)
    model = build_model("plain", seed=1)
    manager.save(1, model)
    (root / step_dir(1) / "eval-results.json").write_text("{}")
    (root / step_dir(1) / "data" / "user-notes.txt").write_text("mine")
    manager.save(2, model)
    assert manager.steps() == [2]
    assert sorted(str(p.relative_to(root / step_dir(1))) for p in (root / step_dir(1)).rglob("*")
                  if p.is_file()) == ["data/user-notes.txt", "eval-results.json"]


def test_load_latest_on_a_fresh_root_returns_none_quietly_and_required_raises(tmp_path, caplog):
    manager = skc.CheckpointManager(str(tmp_path / "new-run"))
    model = build_model("plain", seed=1)
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        assert manager.load_latest(model) is None
    assert _warnings(caplog) == ""
    with pytest.raises(CheckpointNotFound, match="nothing to resume under .*new-run"):
        manager.load_latest(model, required=True)


def test_load_latest_names_foreign_and_interrupted_steps_instead_of_silently_returning_none(tmp_path, caplog):
    root = tmp_path / "run"
    _foreign_steps(root)
    (root / step_dir(9) / "data").mkdir(parents=True)
    (root / step_dir(9) / "data" / "0123456789-0-0.safetensors").write_bytes(b"half")
    manager = skc.CheckpointManager(str(root))
    model = build_model("plain", seed=1)
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        assert manager.load_latest(model) is None
    said = _warnings(caplog)
    assert "torch.distributed.checkpoint" in said and "Hugging Face" in said
    assert f"{step_dir(9)} (an interrupted shardkit save" in said
    with pytest.raises(CheckpointNotFound, match="torch.distributed.checkpoint"):
        manager.load_latest(model, required=True)


def test_load_latest_warns_when_the_root_cannot_be_created(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    manager = skc.CheckpointManager(str(blocker / "run"))
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        assert manager.load_latest(build_model("plain", seed=1)) is None
    assert "cannot be created" in _warnings(caplog)


def test_load_latest_required_raises_when_every_step_is_damaged(tmp_path):
    manager = skc.CheckpointManager(str(tmp_path / "run"))
    model = build_model("plain", seed=1)
    manager.save(1, model)
    data = next((tmp_path / "run" / step_dir(1) / "data").iterdir())
    data.write_bytes(data.read_bytes()[:-8])  # truncated
    with pytest.raises(CheckpointNotFound, match="every committed step .* is damaged"):
        manager.load_latest(model, required=True)


def test_wait_returns_only_after_retention_has_run(tmp_path, monkeypatch):
    slow_survey = retention_module.survey

    def survey_after_a_pause(storage):
        time.sleep(0.3)  # retention lags behind the commit, as on a slow object store
        return slow_survey(storage)

    monkeypatch.setattr(retention_module, "survey", survey_after_a_pause)  # where retention surveys a step
    manager = skc.CheckpointManager(str(tmp_path / "run"), keep_last=1, async_save=True)
    model = build_model("plain", seed=1)
    manager.save(1, model)
    future = manager.save(2, model)
    manager.wait()
    assert future.done()
    assert sorted(os.listdir(tmp_path / "run")) == [step_dir(2)]
