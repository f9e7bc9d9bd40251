"""Ctrl-C: exit 130 with one line; a command whose rerun resumes says so, and no other claims it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from shardkit.checkpoint.formats.native.writer import NativeWriter
from tests.support.offline_cli import run_cli

RESUMES = "rerunning the same command resumes"


@pytest.fixture
def hf(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    # 1 MiB each: with zstd and a 16 MiB budget, files are capped at 1 MiB, so even one rank gets two files
    save_file({"a": torch.randn(512, 512), "b": torch.randn(512, 512)}, str(src / "model.safetensors"))
    return src


def _ctrl_c_on_the_second_file(monkeypatch):
    write_file, calls = NativeWriter.write_file, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return write_file(self, *args, **kwargs)

    monkeypatch.setattr(NativeWriter, "write_file", interrupted)


@pytest.mark.parametrize("command", [["reshard", "--world-size", "2"], ["convert", "--to", "shardkit"]])
def test_ctrl_c_during_native_output_says_a_rerun_resumes_and_the_rerun_does(hf, tmp_path, monkeypatch, command):
    dst = tmp_path / "dst"
    args = [command[0], str(hf), str(dst), *command[1:], "--workers", "1", "--max-memory", "16MiB",
            "--compression", "zstd"]
    with monkeypatch.context() as patch:
        _ctrl_c_on_the_second_file(patch)
        result = run_cli(*args)
    assert result.exit_code == 130
    assert result.stderr.strip().splitlines()[-1] == (
        "error: interrupted; rerunning the same command resumes (the data files already written are verified "
        "and kept)")
    assert not (dst / "manifest.json").exists()
    rerun = run_cli(*args)
    assert rerun.exit_code == 0, rerun.stderr
    assert "of tensor data already there, kept" in rerun.stderr


def test_ctrl_c_during_hf_output_does_not_claim_a_rerun_resumes(hf, tmp_path, monkeypatch):
    import shardkit.checkpoint.formats.hf.writer as hf_format

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_format, "write_hf", interrupted)
    result = run_cli("convert", str(hf), str(tmp_path / "dst"), "--to", "hf")
    assert result.exit_code == 130
    assert result.stderr.strip().splitlines()[-1] == "error: interrupted"
    assert RESUMES not in result.stderr
