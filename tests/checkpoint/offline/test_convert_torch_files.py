"""torch.save files as users write them: a refused class is named with the way out (--trust-pickle),
a trusted file converts with a warning, and classic ``{"model", "optimizer"}`` files keep their
optimizer state, named by parameter, loadable into an optimizer -- or say why it cannot be named."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import shardkit.checkpoint as skc
from shardkit.checkpoint import convert, reshard
from shardkit.checkpoint.formats.torchsave.reader import TorchSaveReader
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import (
    ConfigurationError,
    IncompatibleStateDict,
    UnsafeCheckpoint,
    UnsupportedFormat,
)
from tests.support.models import ModelArgs, Transformer, lm_loss, make_batch
from tests.support.offline_cli import run_cli


@dataclass
class RunConfig:
    """Saved next to the weights the way training scripts do; not on torch's weights_only allowlist."""

    lr: float = 0.1


RUN_CONFIG = "tests.checkpoint.offline.test_convert_torch_files.RunConfig"  # how a refusal names the class


def _trusted_file(path):
    weights = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    torch.save({"model": {"w": weights}, "config": RunConfig(), "step": 4}, path)
    return weights


def test_a_refused_torch_file_names_the_class_and_suggests_trust_pickle(tmp_path):
    src = tmp_path / "run.pt"
    _trusted_file(src)
    with pytest.raises(UnsafeCheckpoint, match=rf"{re.escape(RUN_CONFIG)}.*--trust-pickle"):
        TorchSaveReader(Storage(str(src)))
    for command in (["convert", "--to", "shardkit"], ["reshard", "--world-size", "2"]):
        result = run_cli("-q", command[0], str(src), str(tmp_path / "out"), *command[1:])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1, result.stderr
        assert RUN_CONFIG in lines[0] and "--trust-pickle" in lines[0], lines[0]
        assert not (tmp_path / "out" / "manifest.json").exists()


def test_trust_pickle_converts_a_trusted_file_with_a_warning_and_leaves_out_what_no_checkpoint_holds(
        tmp_path, caplog):
    src = tmp_path / "run.pt"
    weights = _trusted_file(src)
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="shardkit.checkpoint.formats.torchsave.mapped"):
        result = convert(str(src), str(out), to="shardkit", trust_pickle=True)
    warned = [r for r in caplog.records if r.name == "shardkit.checkpoint.formats.torchsave.mapped"]
    assert warned and warned[0].levelno == logging.WARNING and "trust_pickle" in warned[0].getMessage()
    assert result.tensors == 1
    state = {"model": {"w": torch.zeros(5, 3)}, "step": 0}
    skc.load(state, str(out))
    assert torch.equal(state["model"]["w"], weights) and state["step"] == 4
    reader = TorchSaveReader(Storage(str(src)), _options(trust_pickle=True))
    assert reader.skipped_side_files == [f"config: a {RUN_CONFIG}, neither a tensor nor a JSON value"]
    cli = run_cli("reshard", str(src), str(tmp_path / "cli"), "--world-size", "2", "--trust-pickle")
    assert cli.exit_code == 0, cli.stderr
    assert "not copied: config" in cli.stderr


def test_trust_pickle_and_model_keys_are_refused_for_a_source_that_is_not_a_torch_file(tmp_path):
    native = tmp_path / "native"
    torch.save({"model": {"w": torch.ones(3)}}, tmp_path / "a.pt")
    convert(str(tmp_path / "a.pt"), str(native), to="shardkit")
    with pytest.raises(ConfigurationError, match="torch.save sources"):
        convert(str(native), str(tmp_path / "b"), to="shardkit", trust_pickle=True)
    with pytest.raises(ConfigurationError, match="torch.save sources"):
        reshard(str(native), str(tmp_path / "c"), world_size=2, model_keys=["w"])


def _options(**kwargs):
    from shardkit.checkpoint.formats.torchsave.reader import TorchLoadOptions

    return TorchLoadOptions(**kwargs)


def _trained(model: nn.Module, args: ModelArgs | None = None) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for seed in range(2):
        if args is not None:
            tokens, targets = make_batch(args, 2, seed=seed)
            lm_loss(model(tokens), targets).backward()
        else:
            model(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
        optim.step()
        optim.zero_grad()
    return optim


def _loaded_into_fresh(build, url: str, **extra) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """A fresh model and optimizer, filled from ``url`` with ``skc.load`` + ``set_training_state``."""
    torch.manual_seed(123)
    model = build()
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    state = {**skc.get_training_state(model, optim), **extra}
    skc.load(state, url)
    skc.set_training_state(model, optim, state)
    return model, optim, state


def _assert_same_optimizer_state(got: torch.optim.Optimizer, want: torch.optim.Optimizer) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, st in b["state"].items():
        for name, value in st.items():
            assert torch.equal(a["state"][i][name], value), (i, name)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_classic_model_and_optimizer_file_converts_into_state_an_optimizer_loads(tmp_path, tied):
    """``{"model": model.state_dict(), "optimizer": opt.state_dict()}``: the optimizer's parameter numbers
    are named in the model's order (a tied weight counts once), so skc.load fills an optimizer."""
    args = ModelArgs(tie_embeddings=tied)
    torch.manual_seed(0)
    model = Transformer(args)
    optim = _trained(model, args)
    src = tmp_path / "classic.pt"
    torch.save({"model": model.state_dict(), "optimizer": optim.state_dict(), "epoch": 3}, src)

    out = tmp_path / "native"
    convert(str(src), str(out), to="shardkit")
    keys = set(skc.open_reader(str(out)).tensors())
    assert "optim.state.layers.0.attention.wq.weight.exp_avg" in keys
    assert not any(k.startswith("optim.state.0.") or k.startswith("optimizer.") for k in keys)
    fresh, fresh_optim, state = _loaded_into_fresh(lambda: Transformer(args), str(out), epoch=0)
    assert state["epoch"] == 3
    _assert_same_optimizer_state(fresh_optim, optim)
    for (name, p), q in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name

    resharded = tmp_path / "ws2"
    reshard(str(src), str(resharded), world_size=2)
    _, again, _ = _loaded_into_fresh(lambda: Transformer(args), str(resharded), epoch=0)
    _assert_same_optimizer_state(again, optim)


class _Convnet(nn.Module):
    """BatchNorm keeps floating buffers (running_mean/var) among the parameters in its state dict."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(x)).mean(dim=(2, 3)))


def test_optimizer_numbers_that_cannot_be_named_are_refused_saying_why_and_model_keys_names_them(tmp_path):
    torch.manual_seed(0)
    model = _Convnet()
    optim = _trained(model)
    src = tmp_path / "convnet.pt"
    torch.save({"model_state_dict": model.state_dict(), "optimizer_state_dict": optim.state_dict()}, src)

    with pytest.raises(UnsupportedFormat, match=r"list 6 parameters.*holds 8 floating tensors.*--model-keys"):
        convert(str(src), str(tmp_path / "refused"), to="shardkit")
    result = run_cli("-q", "reshard", str(src), str(tmp_path / "refused"), "--world-size", "2")
    assert result.exit_code == 1 and "cannot be named" in result.stderr and "--model-keys" in result.stderr
    assert not (tmp_path / "refused" / "manifest.json").exists()
    convert(str(src), str(tmp_path / "weights"), to="shardkit", model_only=True)  # the way out without names

    keys = tmp_path / "keys.txt"
    keys.write_text("\n".join(name for name, _ in model.named_parameters()) + "\n")
    result = run_cli("-q", "convert", str(src), str(tmp_path / "named"), "--to", "shardkit", "--model-keys",
                     str(keys))
    assert result.exit_code == 0, result.stderr
    _, fresh_optim, _ = _loaded_into_fresh(_Convnet, str(tmp_path / "named"))
    _assert_same_optimizer_state(fresh_optim, optim)


def test_model_keys_in_the_wrong_order_are_refused_by_the_shape_check(tmp_path):
    torch.manual_seed(0)
    model = _Convnet()
    optim = _trained(model)
    src = tmp_path / "convnet.pt"
    torch.save({"model": model.state_dict(), "optimizer": optim.state_dict()}, src)
    names = [name for name, _ in model.named_parameters()]
    names[0], names[-1] = names[-1], names[0]  # conv.weight <-> head.bias
    with pytest.raises(IncompatibleStateDict, match=r"parameter 0's exp_avg is \(4, 3, 3, 3\).*'head.bias'"):
        convert(str(src), str(tmp_path / "out"), to="shardkit", model_keys=names)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_optimizer_state_saved_alone_is_named_by_a_json_model_keys_file(tmp_path):
    args = ModelArgs()
    torch.manual_seed(0)
    model = Transformer(args)
    optim = _trained(model, args)
    src = tmp_path / "optim.pt"
    torch.save(optim.state_dict(), src)
    with pytest.raises(UnsupportedFormat, match="holds no model state dict"):
        convert(str(src), str(tmp_path / "refused"), to="shardkit")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([name for name, _ in model.named_parameters()]))
    result = run_cli("-q", "convert", str(src), str(tmp_path / "out"), "--to", "shardkit", "--model-keys", str(keys))
    assert result.exit_code == 0, result.stderr
    reader = skc.open_reader(str(tmp_path / "out"))
    groups = reader.values()["optim.param_groups"]
    assert groups[0]["params"] == [name for name, _ in model.named_parameters()]
    assert set(reader.tensors()) == {f"optim.state.{name}.{k}" for name, _ in model.named_parameters()
                                     for k in ("exp_avg", "exp_avg_sq", "step")}
    # inspect shows what the file holds, numbered, without failing
    assert "optim.state.0.exp_avg" in run_cli("inspect", str(src)).stdout
