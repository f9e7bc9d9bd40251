"""Resume keeps only data written from the same source: a rerun after SRC changed rewrites everything,
a rerun of the same SRC (however its path is spelled) keeps what was written."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

import shardkit.checkpoint.formats.native.resumable as native_resumable
from shardkit.checkpoint import diff, reshard, verify
from tests.support.offline_helpers import write_torch_state


class _Interrupted(Exception):
    pass


def _interrupt_before_commit(monkeypatch):
    """Make the next reshard stop after every data file is written and journaled, before its manifest."""
    def stop(*args, **kwargs):
        raise _Interrupted()
    monkeypatch.setattr(native_resumable, "commit_resumable", stop)


def _hf_weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 8), value), "b": torch.arange(16, dtype=torch.float32) * value}


def test_rerun_after_hf_source_changed_in_place_writes_the_new_weights(tmp_path, monkeypatch):
    src = tmp_path / "hf"
    src.mkdir()
    save_file(_hf_weights(0.0), str(src / "model.safetensors"), metadata={"format": "pt"})
    dst = tmp_path / "dst"
    with monkeypatch.context() as m:
        _interrupt_before_commit(m)
        with pytest.raises(_Interrupted):
            reshard(str(src), str(dst), world_size=2)
    assert list((dst / ".shardkit-resume").iterdir()) and not (dst / "manifest.json").exists()
    save_file(_hf_weights(1.0), str(src / "model.safetensors"), metadata={"format": "pt"})  # same shapes
    result = reshard(str(src), str(dst), world_size=2)
    assert result.skipped_bytes == 0
    assert diff(str(src), str(dst)).equal and verify(str(dst)).ok
    assert sorted(os.listdir(dst / "data")) == sorted(n.split("/")[-1] for n in result.files if n.startswith("data/"))


def test_rerun_after_native_source_was_rewritten_writes_the_new_values(tmp_path, monkeypatch):
    flat = {"model.w": torch.randn(300, 40, generator=torch.Generator().manual_seed(0))}
    src = str(tmp_path / "native")
    reshard(str(write_torch_state(tmp_path / "a.pt", flat, [])), src, world_size=1)
    dst = str(tmp_path / "dst")
    with monkeypatch.context() as m:
        _interrupt_before_commit(m)
        with pytest.raises(_Interrupted):
            reshard(src, dst, world_size=3)
    flat["model.w"] = flat["model.w"] + 1
    reshard(str(write_torch_state(tmp_path / "b.pt", flat, [])), src, world_size=1, overwrite=True)
    result = reshard(src, dst, world_size=3)
    assert result.skipped_bytes == 0 and diff(src, dst).equal


def _interrupted_reshard_of_a_torch_file(tmp_path, monkeypatch, tensors: int):
    """A torch.save SRC of ``tensors`` tensors and a reshard of it to 2 ranks stopped just before its
    commit: (flat state, SRC path, DST path)."""
    flat = {f"model.w{i}": torch.randn(128, 64, generator=torch.Generator().manual_seed(i)) for i in range(tensors)}
    src = write_torch_state(tmp_path / "src.pt", flat, [])
    dst = tmp_path / "dst"
    with monkeypatch.context() as m:
        _interrupt_before_commit(m)
        with pytest.raises(_Interrupted):
            reshard(str(src), str(dst), world_size=2)
    return flat, src, dst


def test_rerun_of_the_same_source_spelled_relative_resumes(tmp_path, monkeypatch):
    flat, src, dst = _interrupted_reshard_of_a_torch_file(tmp_path, monkeypatch, tensors=3)
    monkeypatch.chdir(tmp_path)
    result = reshard("./src.pt", "dst", world_size=2)
    assert result.skipped_bytes == sum(t.numel() * t.element_size() for t in flat.values())
    assert diff(str(src), str(dst)).equal


def test_a_journaled_file_damaged_before_the_rerun_is_written_again(tmp_path, monkeypatch):
    flat, src, dst = _interrupted_reshard_of_a_torch_file(tmp_path, monkeypatch, tensors=4)
    victim = sorted((dst / "data").iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # same size, one checksum block wrong
    victim.write_bytes(bytes(data))
    result = reshard(str(src), str(dst), world_size=2)
    total = sum(t.numel() * t.element_size() for t in flat.values())
    assert 0 < result.skipped_bytes < total  # the intact file was kept, the damaged one rewritten
    assert verify(str(dst)).ok and diff(str(src), str(dst)).equal


def test_a_journaled_file_whose_header_was_damaged_is_written_again(tmp_path, monkeypatch):
    from safetensors import safe_open

    flat, src, dst = _interrupted_reshard_of_a_torch_file(tmp_path, monkeypatch, tensors=4)
    victim = sorted((dst / "data").iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[data.index(b'"shape"') + 2] ^= 1  # "siape": the header no longer opens; every chunk checksum still holds
    victim.write_bytes(bytes(data))
    result = reshard(str(src), str(dst), world_size=2)
    total = sum(t.numel() * t.element_size() for t in flat.values())
    assert 0 < result.skipped_bytes < total  # the intact file was kept, the one with the damaged header rewritten
    assert verify(str(dst)).ok and diff(str(src), str(dst)).equal
    for file in (dst / "data").iterdir():
        with safe_open(str(file), "pt") as f:
            assert all(f.get_tensor(k).numel() for k in f.keys())


def test_a_rerun_keeps_journaled_files_by_their_stamp_and_header_without_reading_their_data(tmp_path, monkeypatch):
    import shardkit.checkpoint.formats.native.journal as journal

    flat, src, dst = _interrupted_reshard_of_a_torch_file(tmp_path, monkeypatch, tensors=4)

    def no_data_read(*args, **kwargs):
        raise AssertionError("a journaled file's data was read back")
    monkeypatch.setattr(journal, "check_chunk", no_data_read)
    result = reshard(str(src), str(dst), world_size=2)
    assert result.skipped_bytes == sum(t.numel() * t.element_size() for t in flat.values())
    assert verify(str(dst)).ok and diff(str(src), str(dst)).equal


def test_a_record_without_a_stamp_is_kept_only_when_every_checksum_block_reads_back_intact(tmp_path, monkeypatch):
    import json

    flat, src, dst = _interrupted_reshard_of_a_torch_file(tmp_path, monkeypatch, tensors=4)
    for record in (dst / ".shardkit-resume").iterdir():  # as journaled where the filesystem has no stamps
        entry = json.loads(record.read_bytes())
        entry["stamp"] = ""
        record.write_text(json.dumps(entry))
    intact, victim = sorted((dst / "data").iterdir())
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = reshard(str(src), str(dst), world_size=2)
    assert 0 < result.skipped_bytes < sum(t.numel() * t.element_size() for t in flat.values())
    assert verify(str(dst)).ok and diff(str(src), str(dst)).equal
