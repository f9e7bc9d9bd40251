"""A hot copy on disk (training/hot/flat.py): what is written is read back bitwise, and nothing damaged,
truncated or half-written is ever trusted."""

import os

import pytest
import torch

from shardkit.checkpoint.training.hot.flat import (
    DATA_NAME,
    MANIFEST_NAME,
    read_flat,
    read_manifest,
    remove_flat,
    write_flat,
)
from shardkit.errors import CorruptCheckpoint, StorageError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.w": torch.randn(7, 5, generator=g), "model.h": torch.randn(3, 2, generator=g).to(torch.bfloat16),
            "optim.state.0.step": torch.tensor(12.0), "model.empty": torch.empty(0, 4),
            "model.t": torch.randn(4, 6, generator=g).t(), "rng.rank0.cpu": torch.arange(9, dtype=torch.uint8)}


def _write(path) -> str:
    copy = str(path / "rank-0.aaaaaaaaaaaa000001")
    write_flat(copy, _tensors(), {"optim.param_groups.0.lr": 0.5}, {"hot": {"step": 3}})
    return copy


def test_a_copy_reads_back_bitwise_with_its_values_and_meta(tmp_path):
    copy = read_flat(_write(tmp_path))
    for key, t in _tensors().items():
        assert copy.tensors[key].dtype == t.dtype and copy.tensors[key].shape == t.shape
        assert torch.equal(copy.tensors[key], t), key
    assert copy.values == {"optim.param_groups.0.lr": 0.5} and copy.meta == {"hot": {"step": 3}}
    assert sorted(os.listdir(tmp_path)) == ["rank-0.aaaaaaaaaaaa000001"]  # no staging directory left


def test_a_flipped_byte_is_refused_naming_the_file_and_key(tmp_path):
    path = _write(tmp_path)
    offset = next(e[3] for e in read_manifest(path)["tensors"] if e[0] == "model.h")
    with open(os.path.join(path, DATA_NAME), "r+b") as f:
        f.seek(offset + 1)
        byte = f.read(1)
        f.seek(offset + 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CorruptCheckpoint, match=r"state\.bin.*'model\.h'.*checksum"):
        read_flat(path)


def test_a_truncated_data_file_or_a_damaged_manifest_is_refused(tmp_path):
    path = _write(tmp_path)
    data = os.path.join(path, DATA_NAME)
    os.truncate(data, os.path.getsize(data) - 1)
    with pytest.raises(CorruptCheckpoint, match="state.bin holds"):
        read_flat(path)
    other = _write(tmp_path / "b")
    manifest = os.path.join(other, MANIFEST_NAME)
    raw = bytearray(open(manifest, "rb").read())
    raw[20] ^= 0x01  # a byte of the JSON body: its own checksum no longer matches
    open(manifest, "wb").write(bytes(raw))
    with pytest.raises(CorruptCheckpoint, match="manifest.json: not a readable hot-tier copy"):
        read_manifest(other)


def test_a_committed_copy_is_never_replaced_and_a_refused_write_leaves_nothing(tmp_path):
    path = _write(tmp_path)
    before = open(os.path.join(path, DATA_NAME), "rb").read()
    with pytest.raises(StorageError, match="rank-0.aaaaaaaaaaaa000001"):
        write_flat(path, {"model.w": torch.zeros(3)}, {}, {"hot": {"step": 4}})
    assert open(os.path.join(path, DATA_NAME), "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["rank-0.aaaaaaaaaaaa000001"]


def test_removal_takes_the_manifest_and_data_and_leaves_a_foreign_file(tmp_path):
    path = _write(tmp_path)
    open(os.path.join(path, "notes.txt"), "w").write("mine")
    assert remove_flat(path) == ["notes.txt"]
    assert os.listdir(path) == ["notes.txt"]
    os.unlink(os.path.join(path, "notes.txt"))
    write_flat(path + "x", {"model.w": torch.ones(2)}, {}, {})
    assert remove_flat(path + "x") == [] and not os.path.exists(path + "x")
