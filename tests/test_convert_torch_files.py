"""torch.save files as users write them: a refused class is named with the way out (--trust-pickle),
and a trusted file converts with a warning."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.checkpoint import convert, reshard
from shardkit.checkpoint.formats.torchsave import TorchSaveReader
from shardkit.checkpoint.storage import Storage
from shardkit.errors import ConfigurationError, UnsafeCheckpoint
from tests.offline_cli import run_cli


@dataclass
class RunConfig:
    """Saved next to the weights the way training scripts do; not on torch's weights_only allowlist."""

    lr: float = 0.1


def _trusted_file(path):
    weights = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    torch.save({"model": {"w": weights}, "config": RunConfig(), "step": 4}, path)
    return weights


def test_a_refused_torch_file_names_the_class_and_suggests_trust_pickle(tmp_path):
    src = tmp_path / "run.pt"
    _trusted_file(src)
    with pytest.raises(UnsafeCheckpoint, match=r"tests\.test_convert_torch_files\.RunConfig.*--trust-pickle"):
        TorchSaveReader(Storage(str(src)))
    for command in (["convert", "--to", "shardkit"], ["reshard", "--world-size", "2"]):
        result = run_cli("-q", command[0], str(src), str(tmp_path / "out"), *command[1:])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1, result.stderr
        assert "tests.test_convert_torch_files.RunConfig" in lines[0] and "--trust-pickle" in lines[0], lines[0]
        assert not (tmp_path / "out" / "manifest.json").exists()


def test_trust_pickle_converts_a_trusted_file_with_a_warning_and_leaves_out_what_no_checkpoint_holds(
        tmp_path, caplog):
    src = tmp_path / "run.pt"
    weights = _trusted_file(src)
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="shardkit.checkpoint.formats.torchsave"):
        result = convert(str(src), str(out), to="shardkit", trust_pickle=True)
    warned = [r for r in caplog.records if r.name == "shardkit.checkpoint.formats.torchsave"]
    assert warned and warned[0].levelno == logging.WARNING and "trust_pickle" in warned[0].getMessage()
    assert result.tensors == 1
    state = {"model": {"w": torch.zeros(5, 3)}, "step": 0}
    skc.load(state, str(out))
    assert torch.equal(state["model"]["w"], weights) and state["step"] == 4
    reader = TorchSaveReader(Storage(str(src)), _options(trust_pickle=True))
    assert reader.skipped_side_files == ["config: a tests.test_convert_torch_files.RunConfig, neither a tensor nor "
                                         "a JSON value"]
    cli = run_cli("reshard", str(src), str(tmp_path / "cli"), "--world-size", "2", "--trust-pickle")
    assert cli.exit_code == 0, cli.stderr
    assert "not copied: config" in cli.stderr


def test_trust_pickle_is_refused_for_a_source_that_is_not_a_torch_file(tmp_path):
    native = tmp_path / "native"
    torch.save({"model": {"w": torch.ones(3)}}, tmp_path / "a.pt")
    convert(str(tmp_path / "a.pt"), str(native), to="shardkit")
    with pytest.raises(ConfigurationError, match="torch.save sources"):
        convert(str(native), str(tmp_path / "b"), to="shardkit", trust_pickle=True)
    with pytest.raises(ConfigurationError, match="torch.save sources"):
        reshard(str(native), str(tmp_path / "c"), world_size=2, trust_pickle=True)


def _options(**kwargs):
    from shardkit.checkpoint.formats.torchsave import TorchLoadOptions

    return TorchLoadOptions(**kwargs)
