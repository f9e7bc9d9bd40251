"""A flipped byte in a torch.save or DCP source stops ``convert``/``reshard`` naming the file and the
record, before DST is committed; ``verify`` names it too; a source written without checksums still
converts."""

from __future__ import annotations

import io
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from shardkit.checkpoint import convert, diff, reshard, verify
from shardkit.errors import CorruptCheckpoint
from tests.support.offline_cli import run_cli

# what commits each output format: a DST holding none of these is no checkpoint
MARKERS = {"shardkit": ["manifest.json"], "dcp": [".metadata"],
           "hf": ["model.safetensors.index.json", "model.safetensors"]}


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(300, 40, generator=gen), "b": torch.randn(7, generator=gen),
                      # a transposed view: a DCP payload that cannot be read by rows, so it is decoded whole
                      "t": torch.randn(40, 30, generator=gen).t()},
            "step": 3}


def _record_data(archive: bytes, record_suffix: str) -> tuple[str, int, int]:
    """(name, offset of its first byte, size) of the record ending in ``record_suffix``."""
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(record_suffix))
    name_len, extra_len = struct.unpack("<HH", archive[info.header_offset + 26:info.header_offset + 30])
    return info.filename, info.header_offset + 30 + name_len + extra_len, info.file_size


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Pristine torch.save and DCP sources of one state."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("damaged")
    torch.save(_state(), root / "src.pt")
    dcp.save(_state(), checkpoint_id=str(root / "dcp"), no_dist=True)
    return root


def _damaged_torch_file(sources: Path, tmp_path: Path) -> tuple[str, str]:
    """A copy of the .pt with one byte flipped in the payload of ``model.w`` (its largest record)."""
    src = tmp_path / "src.pt"
    shutil.copy(sources / "src.pt", src)
    with zipfile.ZipFile(src) as zf:
        largest = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name, start, size = _record_data(src.read_bytes(), largest.filename)
    _flip(src, start + size // 2)
    return str(src), name


def _damaged_dcp(sources: Path, tmp_path: Path, fqn: str) -> tuple[str, str, str]:
    """A copy of the DCP directory with one byte flipped in the tensor record of ``fqn``'s payload."""
    from shardkit.checkpoint.formats.dcp.reader import DcpReader
    from shardkit.checkpoint.io.storage import Storage

    src = tmp_path / "dcp"
    shutil.copytree(sources / "dcp", src)
    locator = DcpReader(Storage(str(src))).tensors()[fqn].chunks[0].locator
    payload = src / str(locator.relative_path)
    blob = payload.read_bytes()[locator.offset:locator.offset + locator.length]
    name, start, size = _record_data(blob, "/data/0")
    _flip(payload, locator.offset + start + size // 2)
    return str(src), payload.name, name


def _committed(dst: Path, fmt: str) -> bool:
    if fmt == "torch":
        return dst.exists()
    return any((dst / m).exists() for m in MARKERS[fmt])


@pytest.mark.parametrize("to", ["shardkit", "torch", "dcp", "hf"])
def test_convert_from_a_torch_file_with_a_flipped_byte_fails_naming_the_record_and_commits_nothing(
        sources, tmp_path, to):
    src, record = _damaged_torch_file(sources, tmp_path)
    dst = tmp_path / ("out.pt" if to == "torch" else "out")
    with pytest.raises(CorruptCheckpoint, match="CRC-32") as caught:
        convert(src, str(dst), to=to)
    assert src in str(caught.value) and record in str(caught.value) and "model.w" in str(caught.value)
    assert not _committed(dst, to)


def test_reshard_from_a_torch_file_with_a_flipped_byte_fails_naming_the_record_and_commits_nothing(sources, tmp_path):
    src, record = _damaged_torch_file(sources, tmp_path)
    dst = tmp_path / "out"
    with pytest.raises(CorruptCheckpoint, match="CRC-32") as caught:
        reshard(src, str(dst), world_size=3, workers=2)
    assert src in str(caught.value) and record in str(caught.value)
    assert not _committed(dst, "shardkit")


@pytest.mark.parametrize("fqn", ["model.w", "model.t"], ids=["read-by-rows", "decoded-whole"])
@pytest.mark.parametrize("to", ["shardkit", "torch", "dcp"])
def test_convert_from_a_dcp_payload_with_a_flipped_byte_fails_naming_the_record_and_commits_nothing(
        sources, tmp_path, to, fqn):
    src, payload, record = _damaged_dcp(sources, tmp_path, fqn)
    dst = tmp_path / ("out.pt" if to == "torch" else "out")
    with pytest.raises(CorruptCheckpoint, match="CRC-32") as caught:
        convert(src, str(dst), to=to)
    message = str(caught.value)
    assert payload in message and record in message and fqn in message
    assert not _committed(dst, to)


@pytest.mark.parametrize("fqn", ["model.w", "model.t"], ids=["read-by-rows", "decoded-whole"])
def test_reshard_from_a_dcp_payload_with_a_flipped_byte_fails_naming_the_record_and_commits_nothing(
        sources, tmp_path, fqn):
    src, payload, record = _damaged_dcp(sources, tmp_path, fqn)
    dst = tmp_path / "out"
    with pytest.raises(CorruptCheckpoint, match="CRC-32") as caught:
        reshard(src, str(dst), world_size=2, workers=2)
    assert payload in str(caught.value) and record in str(caught.value) and fqn in str(caught.value)
    assert not _committed(dst, "shardkit")


@pytest.mark.parametrize("kind", ["torch", "dcp"])
@pytest.mark.parametrize("command", [["reshard", "--world-size", "2"], ["convert", "--to", "shardkit"],
                                     ["convert", "--to", "torch"]], ids=["reshard", "convert-shardkit",
                                                                         "convert-torch"])
def test_cli_convert_and_reshard_of_a_source_with_a_flipped_byte_exit_non_zero_naming_file_and_record(
        sources, tmp_path, kind, command):
    if kind == "torch":
        src, record = _damaged_torch_file(sources, tmp_path)
        named = Path(src).name
    else:
        src, named, record = _damaged_dcp(sources, tmp_path, "model.w")
    to = command[-1] if command[0] == "convert" else "shardkit"
    dst = tmp_path / ("out.pt" if to == "torch" else "out")
    result = run_cli("-q", command[0], src, str(dst), *command[1:])
    assert result.exit_code == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and named in line and record in line and "CRC-32" in line, line
    assert not _committed(dst, to)


def test_verify_still_names_the_flipped_byte_in_a_torch_file_and_a_dcp_payload(sources, tmp_path):
    src, record = _damaged_torch_file(sources, tmp_path)
    report = verify(src)
    assert not report.ok and record in report.problems[0] and "CRC-32" in report.problems[0]
    dcp_src, payload, dcp_record = _damaged_dcp(sources, tmp_path, "model.w")
    result = run_cli("-q", "verify", dcp_src)
    assert result.exit_code == 1 and payload in result.stderr and dcp_record in result.stderr


def test_undamaged_torch_and_dcp_sources_convert_and_match(sources, tmp_path):
    for name in ("src.pt", "dcp"):
        out = tmp_path / f"{name}-out"
        reshard(str(sources / name), str(out), world_size=2)
        assert diff(str(sources / name), str(out)).equal


def test_a_torch_file_written_without_checksums_converts_and_verifies_as_headers_only(tmp_path):
    from torch.utils.serialization import config

    src = tmp_path / "nocrc.pt"
    config.save.compute_crc32 = False
    try:
        torch.save(_state(), src)
    finally:
        config.save.compute_crc32 = True
    with zipfile.ZipFile(src) as zf:
        assert all(i.CRC == 0 for i in zf.infolist())
    report = verify(str(src))
    assert report.ok and report.scope == "headers" and report.bytes_checked == 0  # no CRC claimed as checked
    out = tmp_path / "out"
    convert(str(src), str(out), to="shardkit")
    assert diff(str(src), str(out)).equal
