"""The library logs what it did (one INFO line per save, commit and load per rank); the command shows
it on request, with global flags before or after the subcommand."""

from __future__ import annotations

import logging

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.errors import IncompatibleStateDict
from tests.support.offline_cli import run_cli
from tests.support.offline_helpers import write_torch_state


def _messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_save_and_load_log_one_info_line_each_with_bytes_seconds_and_url(tmp_path, caplog):
    url = str(tmp_path / "ckpt")
    state = {"model.w": torch.randn(64, 64)}
    with caplog.at_level(logging.INFO, logger="shardkit"):
        skc.save(state, url)
        skc.load({"model.w": torch.empty(64, 64)}, url)
    said = _messages(caplog)
    assert "rank 0 wrote 1 files (16" in said and url in said and " s" in said
    assert f"committed {url}: 1 files from 1 ranks" in said
    assert f"rank 0 loaded 1 tensors (16384 bytes) from {url}" in said


def test_nothing_is_printed_by_default_below_warnings(tmp_path, capfd):
    skc.save({"model.w": torch.ones(4)}, str(tmp_path / "ckpt"))
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("where", ["before", "after"])
def test_global_flags_work_before_or_after_the_subcommand(tmp_path, where):
    src = write_torch_state(tmp_path / "src.pt", {"model.w": torch.ones(8, 8)}, [])
    dst = tmp_path / f"dst-{where}"
    command = ["reshard", str(src), str(dst), "--world-size", "2"]
    result = run_cli(*(["-v"] + command if where == "before" else command + ["-v"]))
    assert result.exit_code == 0, result.stderr
    assert "INFO shardkit.checkpoint.offline.convert: reshard" in result.stderr
    quiet = run_cli("inspect", str(dst), "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    debug = run_cli("inspect", str(tmp_path / "missing"), "--debug")
    assert debug.exit_code == 1 and "Traceback" in debug.stderr


def test_a_bf16_model_loads_an_fp32_checkpoint_only_when_asked(tmp_path):
    url = str(tmp_path / "fp32")
    weights = torch.randn(16, 8)
    skc.save({"model.w": weights}, url)
    target = {"model.w": torch.zeros(16, 8, dtype=torch.bfloat16)}
    with pytest.raises(IncompatibleStateDict, match="dtype_cast=True"):
        skc.load(target, url)
    assert torch.count_nonzero(target["model.w"]) == 0
    skc.load(target, url, dtype_cast=True)
    assert torch.equal(target["model.w"], weights.to(torch.bfloat16))
    with pytest.raises(IncompatibleStateDict):
        skc.load({"model.w": torch.zeros(16, 8, dtype=torch.int32)}, url, dtype_cast=True)
