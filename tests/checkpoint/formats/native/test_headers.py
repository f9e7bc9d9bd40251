"""Every data file's safetensors header is checked: by ``verify``, by ``load`` before any target is written,
and by resume -- against the crc32c the manifest records for it and against the manifest's chunks."""

from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path

import google_crc32c
import pytest
import torch
from safetensors import SafetensorError, safe_open

import shardkit.checkpoint as skc
from shardkit.errors import CorruptCheckpoint
from tests.support.offline_cli import run_cli

MATRIX, VECTOR = "model.w", "model.b"


def _state() -> dict[str, torch.Tensor]:
    return {MATRIX: torch.arange(26 * 51, dtype=torch.float32).reshape(26, 51), VECTOR: torch.ones(5)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("headers") / "ckpt"
    skc.save(_state(), str(path), io_threads=1)  # one data file holding both tensors
    return path


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _data_file(path: Path) -> Path:
    (only,) = sorted((path / "data").iterdir())
    return only


def _header_length(file: Path) -> int:
    return struct.unpack("<Q", file.read_bytes()[:8])[0]


def _flip(file: Path, position: int, bit: int) -> None:
    data = bytearray(file.read_bytes())
    data[position] ^= 1 << bit
    file.write_bytes(bytes(data))


def _flip_in_shape_word(file: Path) -> None:
    """The damage a user met: one bit of the header's JSON, ``"shape"`` becomes ``"siape"``."""
    _flip(file, file.read_bytes().index(b'"shape"') + 2, 0)


def _safe_open_refuses(file: Path) -> bool:
    try:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    except SafetensorError:
        return True
    return False


def _rewrite_header(file: Path, edit) -> None:
    """Replace the header's JSON by ``edit(header)``, padded to its old length (the file keeps its size)."""
    data = file.read_bytes()
    n = _header_length(file)
    text = json.dumps(edit(json.loads(data[8:8 + n])), separators=(",", ":")).encode()
    assert len(text) <= n
    file.write_bytes(data[:8] + text + b" " * (n - len(text)) + data[8 + n:])


def _record_header_as_is(path: Path) -> None:
    """Make the manifest's header record agree with the bytes now in the data file (as a buggy writer would)."""
    manifest = json.loads((path / "manifest.json").read_text())
    for name, info in manifest["files"].items():
        head = (path / name).read_bytes()[:8 + _header_length(path / name)]
        info["header"] = {"size": len(head), "crc32c": _crc(head)}
    (path / "manifest.json").write_text(json.dumps(manifest))


def _forget_header_checksums(path: Path) -> None:
    """The manifest as a writer without header checksums wrote it."""
    manifest = json.loads((path / "manifest.json").read_text())
    for info in manifest["files"].values():
        info.pop("header", None)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _crc(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "little")).decode()


def _problem(path: Path) -> str:
    report = skc.verify(str(path))
    assert not report.ok
    (problem,) = report.problems
    return problem


def test_the_manifest_records_each_data_files_header_size_and_crc32c(saved):
    file = _data_file(saved)
    head = file.read_bytes()[:8 + _header_length(file)]
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["version"] == 1
    assert manifest["files"][f"data/{file.name}"]["header"] == {"size": len(head), "crc32c": _crc(head)}


def test_verify_refuses_a_flipped_bit_in_a_data_file_header(ckpt):
    assert skc.verify(str(ckpt)).ok
    file = _data_file(ckpt)
    _flip_in_shape_word(file)
    assert _safe_open_refuses(file)
    assert _problem(ckpt).startswith(f"{file}: its safetensors header (the first ")


@pytest.mark.parametrize("recorded", [True, False], ids=["with-header-checksum", "older-manifest"])
def test_verify_finds_a_flipped_bit_anywhere_in_a_header(ckpt, recorded):
    """One bit of every byte of the header (the length, the JSON, the padding), one at a time: found by the
    recorded crc32c, and, for checkpoints written before header checksums, by the strict parse and the
    manifest's chunks alone."""
    if not recorded:
        _forget_header_checksums(ckpt)
    file = _data_file(ckpt)
    intact = file.read_bytes()
    missed = []
    for position in range(8 + _header_length(file)):
        _flip(file, position, position % 8)
        if skc.verify(str(ckpt)).ok:
            missed.append(position)
        file.write_bytes(intact)
    assert missed == []
    assert skc.verify(str(ckpt)).ok


@pytest.mark.parametrize("recorded", [True, False], ids=["with-header-checksum", "older-manifest"])
def test_verify_refuses_a_truncated_header(ckpt, recorded):
    if not recorded:
        _forget_header_checksums(ckpt)
    file = _data_file(ckpt)
    n = _header_length(file)
    data = file.read_bytes()
    file.write_bytes(struct.pack("<Q", n - 8) + data[8:])  # the length cuts the JSON short; the size is unchanged
    assert _safe_open_refuses(file)
    problem = _problem(ckpt)
    assert problem.startswith(f"{file}: ") and "header" in problem


@pytest.mark.parametrize("recorded", ["rerecorded", "older-manifest"])
def test_verify_refuses_a_valid_header_that_disagrees_with_the_manifest(ckpt, recorded):
    """A header that parses and is a valid safetensors file, but holds the matrix transposed: safe_open
    would hand out a 51 x 26 tensor; the manifest says 26 x 51."""
    file = _data_file(ckpt)
    key = f"{MATRIX}@0,0"

    def transpose(header):
        header[key]["shape"] = [51, 26]
        return header

    _rewrite_header(file, transpose)
    _record_header_as_is(ckpt) if recorded == "rerecorded" else _forget_header_checksums(ckpt)
    with safe_open(str(file), "pt") as f:
        assert f.get_slice(key).get_shape() == [51, 26]
    problem = _problem(ckpt)
    assert problem.startswith(f"{file}: its safetensors header has entry '{key}' as F32 [51, 26] at bytes ")
    assert "the manifest as F32 [26, 51] at" in problem


def test_load_refuses_a_damaged_header_naming_the_file_and_writes_no_target(ckpt):
    file = _data_file(ckpt)
    _flip_in_shape_word(file)
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    with pytest.raises(CorruptCheckpoint, match=f"^{file}: its safetensors header"):
        skc.load(target, str(ckpt))
    assert all(not v.any() for v in target.values())


def test_load_refuses_a_header_that_disagrees_with_an_older_manifest(ckpt):
    _forget_header_checksums(ckpt)
    file = _data_file(ckpt)

    def rename(header):
        header[f"{VECTOR}@9"] = header.pop(f"{VECTOR}@0")  # the same bytes under another key
        return header

    _rewrite_header(file, rename)
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    with pytest.raises(CorruptCheckpoint, match=f"^{file}: its safetensors header has no entry '{VECTOR}@0'"):
        skc.load(target, str(ckpt))
    assert all(not v.any() for v in target.values())


def test_shardkit_verify_exits_non_zero_naming_the_file_with_the_damaged_header(ckpt):
    file = _data_file(ckpt)
    _flip_in_shape_word(file)
    result = run_cli("verify", str(ckpt))
    assert result.exit_code == 1 and result.stdout == ""
    assert f"damaged: {file}: its safetensors header" in result.stderr


def test_version_3_index_files_carry_the_header_records_and_a_flip_is_found(tmp_path):
    from tests.checkpoint.formats.native.test_indexed import always_indexed

    with always_indexed():
        skc.save(_state(), str(tmp_path / "v3"), io_threads=1)
    manifest = json.loads((tmp_path / "v3" / "manifest.json").read_text())
    (index_name,) = manifest["indexes"]
    index = json.loads((tmp_path / "v3" / index_name).read_text())
    file = _data_file(tmp_path / "v3")
    head = file.read_bytes()[:8 + _header_length(file)]
    assert manifest["version"] == 3
    assert index["headers"] == {f"data/{file.name}": {"size": len(head), "crc32c": _crc(head)}}
    _flip_in_shape_word(file)
    assert _problem(tmp_path / "v3").startswith(f"{file}: its safetensors header (the first ")


def test_a_dedup_step_keeps_the_header_record_of_the_file_it_references(tmp_path):
    manager = skc.CheckpointManager(str(tmp_path), dedup=True)
    model = torch.nn.Linear(51, 26)
    manager.save(1, model, rng=False)
    with torch.no_grad():
        model.bias += 1  # step 2 writes the bias again and references the weight
    manager.save(2, model, rng=False)
    manager.wait()
    first, second = (json.loads((tmp_path / f"step-{s:010d}" / "manifest.json").read_text()) for s in (1, 2))
    name = next(n for n in sorted(second["files"]) if n.startswith("../"))
    assert second["version"] == 4
    assert second["files"][name]["header"] == first["files"][name.split("/", 2)[2]]["header"]
    file = tmp_path / name[len("../"):]
    _flip_in_shape_word(file)
    assert _problem(tmp_path / "step-0000000002").startswith(f"{file}: its safetensors header (the first ")
