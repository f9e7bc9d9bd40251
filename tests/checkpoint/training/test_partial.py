"""Trainable-only saves and partial loads: a fine-tune stores its adapters, and a base checkpoint plus an
adapter checkpoint load into one model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import shardkit.checkpoint as skc
from shardkit.errors import ConfigurationError


class LoraLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (the LoRA shape)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(LoraLinear(64, 256), nn.ReLU(), LoraLinear(256, 64))


def _stored_bytes(url: Path) -> int:
    return sum(f["size"] for f in json.loads((url / "manifest.json").read_text())["files"].values())


def test_a_trainable_only_save_stores_the_adapters_and_their_optimizer_state_alone(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    skc.save(skc.get_training_state(model), str(tmp_path / "base"))
    skc.save(skc.get_training_state(model, opt, trainable_only=True), str(tmp_path / "adapter"))
    keys = skc.inspect(str(tmp_path / "adapter"))["tensors"]
    names = {t["name"] for t in keys}
    assert names and all("lora_" in n for n in names)
    assert {n for n in names if n.startswith("optim.state.")} == {
        f"optim.state.{i}.lora_{ab}.{s}" for i in (0, 2) for ab in "ab" for s in ("exp_avg", "exp_avg_sq", "step")}
    adapter_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    all_params = sum(p.numel() for p in model.parameters())
    share = _stored_bytes(tmp_path / "adapter") / _stored_bytes(tmp_path / "base")
    assert share < 3.5 * adapter_params / all_params  # weights + two moments of the adapters, plus headers


def test_a_base_and_an_adapter_checkpoint_load_into_one_model_and_give_its_logits_bitwise(tmp_path):
    trained = _model(0)
    opt = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        trained(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    skc.save(skc.get_training_state(trained), str(tmp_path / "base"), only=["model.*.base.*"])
    skc.save(skc.get_training_state(trained, trainable_only=True), str(tmp_path / "adapter"))

    fresh = _model(1)
    target = skc.get_training_state(fresh)
    base = skc.load(target, str(tmp_path / "base"), strict=False)
    assert base.missing == sorted(f"model.{i}.lora_{ab}" for i in (0, 2) for ab in "ab")
    assert base.unexpected == []
    adapter = skc.load(target, str(tmp_path / "adapter"), strict=False)
    assert adapter.missing == sorted(f"model.{i}.base.{w}" for i in (0, 2) for w in ("weight", "bias"))
    skc.set_training_state(fresh, None, target)
    x = torch.randn(5, 64)
    assert torch.equal(fresh(x), trained(x))


def test_a_save_whose_selection_keeps_nothing_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="keep no key"):
        skc.save(skc.get_training_state(_model(0)), str(tmp_path / "x"), only=["optim.*"])
    assert not (tmp_path / "x" / "manifest.json").exists()
