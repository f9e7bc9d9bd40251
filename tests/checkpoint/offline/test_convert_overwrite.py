"""--overwrite replaces a checkpoint completely: after the commit nothing of the old one is left, and
anything the target format cannot hold is refused before the old checkpoint is touched."""

from __future__ import annotations

import json
import os

import torch

from shardkit.checkpoint import convert, diff, reshard
from tests.support.offline_cli import run_cli
from tests.support.offline_helpers import write_torch_state


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(64, 64, generator=gen) for i in range(6)}


def test_overwriting_an_hf_export_removes_shards_the_new_index_does_not_name(tmp_path):
    src = write_torch_state(tmp_path / "src.pt", _weights(), [])
    out = tmp_path / "hf"
    convert(str(src), str(out), to="hf", max_shard_size="20KB")
    assert len(list(out.glob("*.safetensors"))) == 6
    (out / "README.md").write_text("mine")
    convert(str(src), str(out), to="hf", max_shard_size="60KB", overwrite=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(index["weight_map"].values()))
    assert len(set(index["weight_map"].values())) == 2
    assert (out / "README.md").read_text() == "mine"  # not a checkpoint file: left alone
    assert diff(str(src), str(out), only=["model.*"]).equal


def test_overwriting_between_one_shard_and_several_leaves_only_the_new_export(tmp_path):
    src = write_torch_state(tmp_path / "src.pt", _weights(), [])
    out = tmp_path / "hf"
    convert(str(src), str(out), to="hf", max_shard_size="40KB")
    assert len(list(out.glob("model-*-of-00003.safetensors"))) == 3
    convert(str(src), str(out), to="hf", overwrite=True)  # 98 KB under the 5GB default: one shard
    assert sorted(os.listdir(out)) == ["model.safetensors"] and diff(str(src), str(out)).equal
    convert(str(src), str(out), to="hf", max_shard_size="40KB", overwrite=True)
    assert sorted(os.listdir(out)) == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                       "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    assert diff(str(src), str(out)).equal


def test_overwriting_a_native_checkpoint_with_another_format_leaves_none_of_its_files(tmp_path):
    src = write_torch_state(tmp_path / "src.pt", _weights(), [])
    out = tmp_path / "out"
    reshard(str(src), str(out), world_size=3)
    convert(str(src), str(out), to="dcp", overwrite=True)
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp"]
    reshard(str(src), str(out), world_size=2, overwrite=True)
    assert sorted(os.listdir(out)) == ["data", "manifest.json"] and len(os.listdir(out / "data")) == 2
    assert diff(str(src), str(out)).equal


def test_a_dtype_the_target_cannot_hold_is_refused_before_dst_is_touched(tmp_path):
    flat = {"model.w": torch.randn(8, 8), "model.z": torch.randn(4, dtype=torch.complex64)}
    src = write_torch_state(tmp_path / "src.pt", flat, [])
    out = tmp_path / "out"
    reshard(str(write_torch_state(tmp_path / "ok.pt", {"model.w": flat["model.w"]}, [])), str(out), world_size=1)
    before = (out / "manifest.json").read_bytes()
    for to in ("hf", "shardkit"):  # safetensors has no complex dtype (DCP and torch.save do)
        result = run_cli("-q", "convert", str(src), str(out), "--to", to, "--overwrite")
        assert result.exit_code == 1 and "model.z" in result.stderr, (to, result.stderr)
        assert (out / "manifest.json").read_bytes() == before
    result = run_cli("-q", "convert", str(src), str(out), "--to", "hf", "--overwrite", "--exclude", "model.z")
    assert result.exit_code == 0, result.stderr
    assert not (out / "manifest.json").exists() and not (out / "data").exists()


def test_overwriting_an_hf_export_never_writes_over_a_shard_the_old_index_names(tmp_path, monkeypatch):
    first = write_torch_state(tmp_path / "first.pt", _weights(), [])
    second = write_torch_state(tmp_path / "second.pt", {k: v + 1 for k, v in _weights().items()}, [])
    out = tmp_path / "hf"
    convert(str(first), str(out), to="hf", max_shard_size="60KB")
    old_index = json.loads((out / "model.safetensors.index.json").read_text())
    old_shards = {name: (out / name).read_bytes() for name in set(old_index["weight_map"].values())}

    from shardkit.checkpoint.io.storage import Storage

    def checked_put(self, name, data, _put=Storage.put_atomic):  # the commit: the old export is still whole
        if name == "model.safetensors.index.json":
            assert {n: (out / n).read_bytes() for n in old_shards} == old_shards
        return _put(self, name, data)

    monkeypatch.setattr(Storage, "put_atomic", checked_put)
    convert(str(second), str(out), to="hf", max_shard_size="60KB", overwrite=True)
    new_index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not set(new_index["weight_map"].values()) & set(old_shards)
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(new_index["weight_map"].values()))
    assert diff(str(second), str(out)).equal


def test_overwriting_a_dcp_or_torch_output_keeps_the_old_one_whole_until_the_commit(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from shardkit.checkpoint.io.storage import Storage

    first = write_torch_state(tmp_path / "first.pt", _weights(), [])
    second = write_torch_state(tmp_path / "second.pt", {k: v + 1 for k, v in _weights().items()}, [])
    out = tmp_path / "dcp"
    convert(str(first), str(out), to="dcp")
    old = {p.name: p.read_bytes() for p in out.iterdir()}

    def checked_put(self, name, data, _put=Storage.put_atomic):
        if name == ".metadata":  # the commit: every byte of the old checkpoint is still there
            assert {n: (out / n).read_bytes() for n in old} == old
        return _put(self, name, data)

    monkeypatch.setattr(Storage, "put_atomic", checked_put)
    convert(str(second), str(out), to="dcp", overwrite=True)
    assert [p.name for p in out.glob("*.distcp")] != ["__0_0.distcp"]
    loaded = {k: torch.empty(64, 64) for k in _weights()}
    dcp.load({"model": {k[len("model."):]: v for k, v in loaded.items()}}, checkpoint_id=str(out), no_dist=True)
    assert all(torch.equal(loaded[k], v + 1) for k, v in _weights().items())

    torch_out = tmp_path / "model.pt"
    convert(str(first), str(torch_out), to="torch")
    original = torch_out.read_bytes()
    monkeypatch.setattr("os.replace", _fail_replace)
    try:
        convert(str(second), str(torch_out), to="torch", overwrite=True)
    except OSError:
        pass
    assert torch_out.read_bytes() == original  # a failure before the rename leaves the old file as it was
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


def _fail_replace(src, dst):
    raise OSError("disk vanished")


def test_a_cleanup_that_fails_after_the_commit_warns_and_never_says_it_removed_the_files(tmp_path, monkeypatch,
                                                                                          caplog):
    import logging

    from shardkit.checkpoint.io.storage import Storage
    from shardkit.errors import StorageError

    src = write_torch_state(tmp_path / "src.pt", _weights(), [])
    out = tmp_path / "out"
    convert(str(src), str(out), to="hf", max_shard_size="20KB")

    def refused(self, names):
        raise StorageError(f"deleting under {self.url}: permission denied")
    monkeypatch.setattr(Storage, "delete", refused)
    with caplog.at_level(logging.INFO, logger="shardkit"):
        convert(str(src), str(out), to="dcp", overwrite=True)  # committed; the old shards cannot go
    assert "could not remove 7 files of the replaced checkpoint" in caplog.text
    assert "removed 7 files" not in caplog.text
    assert diff(str(src), str(out), only=["model.*"]).equal  # the new checkpoint stands
