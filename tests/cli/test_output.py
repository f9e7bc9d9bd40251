"""The words of the command's reports: counts agree with their nouns, and tensor data is never confused with
the (compressed) bytes stored."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from shardkit.cli.render import human_bytes
from tests.support.offline_cli import run_cli


@pytest.fixture
def one_tensor(tmp_path):
    """An HF folder holding one tensor, and that folder resharded for one rank."""
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(hf / "model.safetensors"))
    native = tmp_path / "native"
    result = run_cli("reshard", str(hf), str(native), "--world-size", "1")
    assert result.exit_code == 0, result.stderr
    return hf, native, result


def test_counts_of_one_are_singular_in_every_report(one_tensor):
    hf, native, resharded = one_tensor
    assert "reshard → 1 rank " in resharded.stderr and "1 ranks" not in resharded.stderr
    assert f"wrote shardkit checkpoint {native}: 1 tensor, " in resharded.stderr
    inspected = run_cli("inspect", str(native)).stdout
    assert "total: 1 tensor, 48 B of tensor data (model 48 B, optimizer 0 B) in 1 chunk, 48 B stored" in inspected
    assert f"ok: shardkit checkpoint {native}: 1 tensor, " in run_cli("verify", str(native)).stdout
    compared = run_cli("diff", str(hf), str(native)).stdout
    assert compared.splitlines()[-1] == "equal: 1 of 1 tensor bitwise equal, max abs diff 0, 0 values differ"


def test_counts_of_several_are_plural(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.zeros(4, 2), "b": torch.ones(4, 2)}, str(hf / "model.safetensors"))
    result = run_cli("reshard", str(hf), str(tmp_path / "native"), "--world-size", "2")
    assert result.exit_code == 0, result.stderr
    assert "reshard → 2 ranks " in result.stderr and ": 2 tensors, " in result.stderr
    inspected = run_cli("inspect", str(tmp_path / "native")).stdout
    assert "total: 2 tensors, 64 B of tensor data (model 64 B, optimizer 0 B) in 4 chunks, 64 B stored" in inspected


def test_a_compressed_reshard_tells_tensor_data_from_stored_bytes_as_inspect_and_verify_do(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.zeros(256, 256)}, str(hf / "model.safetensors"))  # 262.14 KB, compresses well
    native = tmp_path / "native"
    wrote = run_cli("reshard", str(hf), str(native), "--world-size", "2", "--compression", "zstd")
    assert wrote.exit_code == 0, wrote.stderr
    stored = human_bytes(json.loads(run_cli("inspect", str(native), "--json").stdout)["totals"]["stored_bytes"])
    assert stored != "262.14 KB"
    assert f"wrote shardkit checkpoint {native}: 1 tensor, 262.14 KB of tensor data, {stored} stored" in wrote.stderr
    assert (f"total: 1 tensor, 262.14 KB of tensor data (model 262.14 KB, optimizer 0 B) in 2 chunks, {stored} "
            "stored") in run_cli("inspect", str(native)).stdout
    assert f"ok: shardkit checkpoint {native}: 1 tensor, {stored} stored, checked in " in \
        run_cli("verify", str(native)).stdout
    report = json.loads(run_cli("verify", str(native), "--json").stdout)
    assert human_bytes(report["bytes_checked"]) == stored
