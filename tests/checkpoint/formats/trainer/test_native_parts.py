"""A Trainer/Accelerate folder whose ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` are shardkit checkpoints
(what ``use_shardkit()`` writes under Accelerate's names) reads as one trainer checkpoint: it converts to a
Hugging Face folder holding the model bitwise, keeps the optimizer state, and verify checks every block."""

from __future__ import annotations

import json

import pytest
import torch

from shardkit.checkpoint import convert, inspect, save, verify
from shardkit.checkpoint.formats import open_reader
from shardkit.checkpoint.formats.base import read_box

safetensors_torch = pytest.importorskip("safetensors.torch")


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.proj = torch.nn.Linear(6, 5)


@pytest.fixture
def folder(tmp_path):
    """checkpoint-3/ as the Trainer writes it under use_shardkit(): two shardkit parts, its state file."""
    torch.manual_seed(0)
    model = Tiny()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.proj(model.embed(torch.tensor([1, 4, 9]))).sum().backward()
    optim.step()
    osd = optim.state_dict()
    params = [n for n, _ in model.named_parameters()]
    state = {params[i]: s for i, s in osd["state"].items()}
    groups = [{**g, "params": [params[i] for i in g["params"]]} for g in osd["param_groups"]]
    ckpt = tmp_path / "checkpoint-3"
    save({"model": model.state_dict()}, str(ckpt / "pytorch_model_fsdp_0"))
    save({"optim": {"state": state, "param_groups": groups}}, str(ckpt / "optimizer_0"))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    return ckpt, model, state


def test_native_parts_convert_to_a_hugging_face_folder_holding_the_model_bitwise(folder, tmp_path):
    ckpt, model, _ = folder
    described = inspect(str(ckpt))
    assert described["format"] == "trainer" and described["meta"]["step"] == 3
    assert described["meta"]["parts"] == ["pytorch_model_fsdp_0", "optimizer_0"]
    out = tmp_path / "hf"
    convert(str(ckpt), str(out), to="hf")
    written = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert sorted(written) == sorted(model.state_dict())
    assert all(torch.equal(written[k], v) for k, v in model.state_dict().items())


def test_native_parts_keep_the_optimizer_state_and_its_param_groups(folder):
    ckpt, model, state = folder
    reader = open_reader(str(ckpt))
    try:
        for fqn, per_param in state.items():
            for name, tensor in per_param.items():
                assert torch.equal(read_box(reader, f"optim.state.{fqn}.{name}"), tensor), (fqn, name)
        assert reader.values()["optim.param_groups"][0]["params"] == [n for n, _ in model.named_parameters()]
    finally:
        reader.close()


def test_verify_checks_the_native_parts_and_names_a_damaged_data_file(folder):
    ckpt, _, _ = folder
    report = verify(str(ckpt))
    assert report.ok and report.bytes_checked > 0
    data = next((ckpt / "optimizer_0").rglob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    damaged = verify(str(ckpt))
    assert not damaged.ok and any(data.name in p for p in damaged.problems)
