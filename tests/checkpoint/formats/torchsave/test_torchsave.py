"""torch.save sources and outputs: values JSON cannot spell survive every hop, an optimizer state
dict saved alone stays optimizer state, dtypes are checked before DST is touched, and a failed
download leaves no spool file."""

from __future__ import annotations

import math
import os

import pytest
import torch

from shardkit.checkpoint import convert, diff, reshard
from shardkit.checkpoint.formats.base import read_box
from shardkit.checkpoint.formats.torchsave.reader import TorchSaveReader
from shardkit.checkpoint.formats.torchsave.writer import check_tensors, write_torch_save
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ConfigurationError, StorageError, UnsupportedFormat
from tests.support.dist import run_on_ranks
from tests.support.models import ModelArgs, Transformer, lm_loss, make_batch


def _nonfinite_source(tmp_path):
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "src.pt"
    torch.save({"model": {"w": w}, "best_loss": float("inf"), "x": float("nan"),
                "extra": {"worst": float("-inf"), "step": 7}}, path)
    return str(path), w


def test_non_finite_values_go_torch_to_native_to_torch_and_dcp_as_floats(tmp_path):
    import torch.distributed.checkpoint as dcp

    src, w = _nonfinite_source(tmp_path)
    native = str(tmp_path / "native")
    reshard(src, native, world_size=1)  # the manifest commit used to refuse inf/nan
    assert diff(src, native).equal

    convert(native, str(tmp_path / "out.pt"), to="torch")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["best_loss"] == math.inf and math.isnan(got["x"])
    assert got["extra"] == {"worst": -math.inf, "step": 7}  # nested again, not "extra.worst"
    assert torch.equal(got["model"]["w"], w)

    convert(native, str(tmp_path / "dcp"), to="dcp")
    state = {"model": {"w": torch.zeros(6, 4)}, "best_loss": 0.0, "x": 0.0, "extra": {"worst": 0.0, "step": 0}}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert state["best_loss"] == math.inf and math.isnan(state["x"])
    assert state["extra"] == {"worst": -math.inf, "step": 7}
    assert torch.equal(state["model"]["w"], w)
    assert diff(native, str(tmp_path / "dcp")).equal and diff(native, str(tmp_path / "out.pt")).equal


def test_torch_save_source_is_flattened_like_shardkit_save(tmp_path):
    """Int-keyed optimizer state (torch's own state_dict) is named after the model's parameters, tuples
    read; keys match flatten's."""
    torch.save({"model": {"w": torch.ones(2)}, "optim": {"state": {0: {"exp_avg": torch.zeros(2)}},
                                                        "param_groups": [{"params": [0], "betas": (0.9, 0.99)}]}},
               tmp_path / "a.pt")
    reader = TorchSaveReader(Storage(str(tmp_path / "a.pt")))
    assert sorted(reader.tensors()) == ["model.w", "optim.state.w.exp_avg"]
    assert reader.values() == {"optim.param_groups": [{"params": ["w"], "betas": [0.9, 0.99]}]}


def _torch_fsdp1_full_optim_state(path: str) -> dict | None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    torch.manual_seed(0)
    args = ModelArgs()
    model = TorchFSDP(Transformer(args), device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = make_batch(args, 2, seed=dist.get_rank())
    lm_loss(model(tokens), targets).backward()
    optim.step()
    osd = TorchFSDP.full_optim_state_dict(model, optim)
    if dist.get_rank() == 0:
        torch.save(osd, path)
    dist.barrier()
    return osd if dist.get_rank() == 0 else None


def test_torch_fsdp1_full_optim_state_dict_file_converts_as_optimizer_state(tmp_path):
    path = str(tmp_path / "optim.pt")
    osd = run_on_ranks(2, _torch_fsdp1_full_optim_state, path)[0]
    assert set(osd) == {"state", "param_groups"} and "tok_embeddings.weight" in osd["state"]

    native = str(tmp_path / "native")
    reshard(path, native, world_size=2, dtype="bf16")  # --dtype casts model weights only
    from shardkit.checkpoint.formats.native.reader import NativeReader

    reader = NativeReader(native)
    keys = set(reader.tensors())
    want = {f"optim.state.{fqn}.{name}" for fqn, st in osd["state"].items() for name in st}
    assert keys == want and not any(k.startswith("model.") for k in keys)
    for fqn, st in osd["state"].items():
        for name, value in st.items():
            got = read_box(reader, f"optim.state.{fqn}.{name}")
            assert got.dtype == value.dtype and torch.equal(got, value), (fqn, name)
    groups = reader.values()["optim.param_groups"]
    assert groups[0]["params"] == osd["param_groups"][0]["params"] and groups[0]["lr"] == 1e-2
    # an HF export has no model weights to take from it
    with pytest.raises(ConfigurationError, match="keep no tensor"):
        convert(path, str(tmp_path / "hf"), to="hf")


def test_unsupported_output_dtype_is_refused_before_writing(tmp_path):
    with pytest.raises(UnsupportedFormat, match="'model.u'.*uint16"):
        check_tensors([("model.w", torch.float32, (2,)), ("model.u", torch.uint16, (3,))])
    with pytest.raises(UnsupportedFormat, match="model.u"):
        write_torch_save(Storage(str(tmp_path)), "x.pt", [("model.u", torch.uint16, (3,))], {},
                         lambda f, o, s: torch.zeros(s, dtype=torch.uint16), block_bytes=1 << 20)
    assert os.listdir(tmp_path) == []


def test_failed_download_leaves_no_spool_file(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    storage = Storage("memory://formats-spool/missing-dir/model.pt")

    def fail(*args, **kwargs):
        raise PermissionError("denied")

    monkeypatch.setattr(type(storage.fs), "get_file", fail)
    with pytest.raises(StorageError, match="permission denied"):
        TorchSaveReader(storage)
    assert os.listdir(tmp_path) == []
