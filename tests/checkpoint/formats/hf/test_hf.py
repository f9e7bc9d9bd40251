"""Hugging Face folders: greedy shards under the cap (one shard: ``model.safetensors``, no index), names that
leave ``model.`` refused, side files allowlisted and capped, index paths kept inside the folder, verify honest
about headers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardkit.checkpoint import convert, verify
from shardkit.checkpoint.formats.base import read_box
from shardkit.checkpoint.formats.hf import reader as hf
from shardkit.checkpoint.formats.hf.reader import INDEX_NAME, HfReader
from shardkit.checkpoint.formats.hf.writer import write_hf
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ConfigurationError, UnsafeCheckpoint


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = [3, 40, 7, 25, 25, 1, 60, 2, 9]  # uneven sizes so the greedy packing is exercised
    return {f"layers.{i}.weight": torch.randn(r, 16, generator=g) for i, r in enumerate(rows)}


def test_shards_are_greedy_in_key_order_and_none_could_take_the_next_tensor(tmp_path):
    tensors = _tensors()
    triples = [(f"model.{k}", v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    cap = 50 * 16 * 4
    write_hf(Storage(str(tmp_path)), triples, lambda f, o, s: tensors[f[len("model."):]][o[0]:o[0] + s[0]],
             block_bytes=1 << 20, max_shard_size=cap)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    order = list(tensors)
    shards: dict[str, list[str]] = {}
    for key in order:  # key order, so shard contents are runs of consecutive keys
        shards.setdefault(index["weight_map"][key], []).append(key)
    names = sorted(shards)
    assert names == [f"model-{k:05d}-of-{len(names):05d}.safetensors" for k in range(1, len(names) + 1)]
    assert [k for n in names for k in shards[n]] == order
    for i, name in enumerate(names):
        size = sum(tensors[k].nbytes for k in shards[name])
        assert size <= cap or len(shards[name]) == 1  # only a lone tensor may exceed the cap
        if i + 1 < len(names):
            following = tensors[shards[names[i + 1]][0]].nbytes
            assert size + following > cap, f"{name} could still take {shards[names[i + 1]][0]}"
    reader = HfReader(Storage(str(tmp_path)))
    for key, value in tensors.items():
        assert torch.equal(read_box(reader, f"model.{key}"), value)


def test_one_shard_is_model_safetensors_without_an_index_as_save_pretrained_writes_it(tmp_path):
    tensors = _tensors()
    triples = [(f"model.{k}", v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    names = write_hf(Storage(str(tmp_path)), triples, lambda f, o, s: tensors[f[len("model."):]][o[0]:o[0] + s[0]],
                     block_bytes=1 << 10, max_shard_size=sum(v.nbytes for v in tensors.values()))
    assert names == ["model.safetensors"] and sorted(p.name for p in tmp_path.iterdir()) == names
    theirs = load_file(str(tmp_path / "model.safetensors"))
    assert theirs.keys() == tensors.keys() and all(torch.equal(theirs[k], v) for k, v in tensors.items())
    reader = HfReader(Storage(str(tmp_path)))
    assert all(torch.equal(read_box(reader, f"model.{k}"), v) for k, v in tensors.items())


def test_rename_out_of_model_prefix_is_refused_naming_the_key(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save_file({"norm.weight": torch.ones(4), "layers.0.weight": torch.ones(2, 2)}, str(src / "model.safetensors"))
    dst = tmp_path / "dst"
    with pytest.raises(ConfigurationError, match=r"'backbone\.(norm|layers\.0)\.weight'.*model\."):
        convert(str(src), str(dst), to="hf", rename=[r"^model\.=backbone."])
    assert not dst.exists()
    # a rename that keeps the prefix is fine, and only the part after "model." names the HF key
    convert(str(src), str(dst), to="hf", rename=[r"^model\.layers\.=model.blocks."])
    assert sorted(HfReader(Storage(str(dst))).tensors()) == ["model.blocks.0.weight", "model.norm.weight"]


def test_side_files_are_allowlisted_capped_and_odd_names_skipped_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(hf, "SIDE_FILE_CAP", 1000)
    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.arange(6.0)}, str(src / "model.safetensors"))
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "tokenizer.model").write_bytes(b"\x00sp")
    (src / "vocab.json").write_text("{}")
    (src / "README copy.md").write_text("notes")          # check_name refuses the space
    (src / "pytorch_model.bin").write_bytes(b"PK" * 10)    # weights in another format
    (src / "big.txt").write_bytes(b"x" * 1001)             # over the cap
    (src / "original").mkdir()
    (src / ".gitattributes").write_text("*.bin lfs")
    reader = HfReader(Storage(str(src)))
    assert reader.side_files == ["config.json", "tokenizer.model", "vocab.json"]
    skipped = "\n".join(reader.skipped_side_files)
    for name in ("README copy.md", "pytorch_model.bin", "big.txt", "original"):
        assert name in skipped, name
    assert ".gitattributes" not in skipped and len(reader.skipped_side_files) == 4

    dst = tmp_path / "dst"
    convert(str(src), str(dst), to="hf")
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model",
                                                      "vocab.json"]
    assert (dst / "config.json").read_text() == '{"model_type": "llama"}'


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_naming_a_file_outside_the_folder_is_refused(tmp_path, target):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {"w": target}}))
    with pytest.raises(UnsafeCheckpoint, match="outside the checkpoint"):
        HfReader(Storage(str(tmp_path)))


def test_verify_of_hf_says_it_checked_headers_only(tmp_path):
    save_file({"w": torch.ones(1000)}, str(tmp_path / "model.safetensors"))
    report = verify(str(tmp_path))
    assert report.ok and report.scope == "headers" and report.bytes_checked == 0
    assert report.to_json()["scope"] == "headers"
