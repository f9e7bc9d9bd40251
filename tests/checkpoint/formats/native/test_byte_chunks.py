"""A native data file written from bytes is the file written from tensors: chunks whose dtype is a code
(``"F32"``) and whose data is a buffer of their bytes land byte for byte as the same chunks given as tensors,
with the same records, manifest and planned file names -- what a byte passthrough between native checkpoints
needs of the writer, and it needs no torch for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardkit.checkpoint.formats.base import WriteChunk
from shardkit.checkpoint.formats.crc32c import BlockCrc
from shardkit.checkpoint.formats.dtypes import (
    CODE_TORCH_NAMES,
    code_to_dtype,
    dtype_spelling,
    dtype_to_code,
    itemsize,
)
from shardkit.checkpoint.formats.native.chunk_reads import read_rows
from shardkit.checkpoint.formats.native.resumable import plan_files
from shardkit.checkpoint.formats.native.writer import NativeWriter, data_file_name
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ChecksumMismatch, InvalidManifest, UnsupportedFormat

ROOT = Path(__file__).resolve().parents[4]


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"w": torch.randn(9, 5, generator=gen), "step": torch.arange(7, dtype=torch.int64),
            "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5, dtype=torch.float64)}


def _chunks(tensors: dict[str, torch.Tensor], as_bytes: bool) -> list[WriteChunk]:
    out = []
    for name, t in tensors.items():
        if as_bytes:
            out.append(WriteChunk(name, dtype_to_code(t.dtype), (0,) * t.dim(), tuple(t.shape),
                                  memoryview(t.numpy().tobytes())))
        else:
            out.append(WriteChunk(name, t.dtype, (0,) * t.dim(), tuple(t.shape), t))
    return out


def test_a_file_written_from_bytes_is_the_file_written_from_tensors(tmp_path):
    tensors = _tensors()
    a, b = Storage(str(tmp_path / "a")), Storage(str(tmp_path / "b"))
    name = data_file_name("0123456789", 0, 0)
    from_tensors = NativeWriter(a, block_bytes=64).write_file(name, _chunks(tensors, as_bytes=False))
    from_bytes = NativeWriter(b, block_bytes=64).write_file(name, _chunks(tensors, as_bytes=True))
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert from_bytes == from_tensors
    shapes = {k: (t.dtype, t.shape) for k, t in tensors.items()}
    coded = {k: (dtype_to_code(t.dtype), t.shape) for k, t in tensors.items()}
    assert (NativeWriter(b).build_manifest(coded, [from_bytes])
            == NativeWriter(a).build_manifest(shapes, [from_tensors]))


def test_bytes_of_the_wrong_size_are_refused_before_a_byte_lands(tmp_path):
    chunk = WriteChunk("w", "F32", (0, 0), (2, 3), memoryview(bytes(20)))
    with pytest.raises(ValueError, match="20 bytes of data, planned 24"):
        NativeWriter(Storage(str(tmp_path))).write_file(data_file_name("0123456789", 0, 0), [chunk])


def test_a_plan_of_codes_is_the_plan_of_dtypes():
    specs = [("w", torch.float32, (10, 6)), ("b", torch.bfloat16, (10,)), ("n", torch.int64, ())]
    coded = [(n, dtype_to_code(d), s) for n, d, s in specs]
    assert plan_files(coded, 3, 64, 1 << 30, "salt") == plan_files(specs, 3, 64, 1 << 30, "salt")


def test_every_code_is_spelled_and_sized_as_its_torch_dtype():
    for code in CODE_TORCH_NAMES:
        if not hasattr(torch, CODE_TORCH_NAMES[code]):
            continue  # a float8 kind this torch lacks
        dtype = code_to_dtype(code)
        assert dtype_spelling(code) == str(dtype) == dtype_spelling(dtype)
        assert itemsize(code) == itemsize(dtype) == dtype.itemsize
        assert dtype_to_code(code) == dtype_to_code(dtype) == code
    with pytest.raises(InvalidManifest, match="unknown dtype 'F12'"):
        dtype_spelling("F12")
    with pytest.raises(UnsupportedFormat, match="F12 cannot be stored"):
        dtype_to_code("F12")


def test_block_checksums_of_a_buffer_are_those_of_its_tensor():
    data = torch.randn(1000).view(torch.uint8)
    from_tensor, from_buffer, from_array = BlockCrc(256), BlockCrc(256), BlockCrc(256)
    from_tensor.update(data)
    view = memoryview(data.numpy().tobytes())
    from_buffer.update(view[:100])
    from_buffer.update(view[100:])
    from_array.update(data.numpy().view(np.float32))
    assert from_buffer.finish() == from_tensor.finish() == from_array.finish()


def test_a_file_is_written_from_bytes_without_torch(tmp_path):
    code = f"""
import sys
sys.modules['torch'] = None
from shardkit.checkpoint.formats.base import WriteChunk
from shardkit.checkpoint.formats.native.writer import NativeWriter
from shardkit.checkpoint.io.storage import Storage
chunk = WriteChunk("w", "F32", (0, 0), (2, 3), memoryview(bytes(range(24))))
wf = NativeWriter(Storage({str(tmp_path)!r})).write_file("data/0123456789-0-0.safetensors", [chunk])
print(wf.chunks[0][1].nbytes)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["24"]
    read = torch.frombuffer(bytearray((tmp_path / "data/0123456789-0-0.safetensors").read_bytes()[-24:]),
                            dtype=torch.uint8)
    assert read.tolist() == list(range(24))


def _saved_matrix(tmp_path: Path) -> tuple[Storage, torch.Tensor, object]:
    storage = Storage(str(tmp_path / "ck"))
    t = torch.randn(10, 6, generator=torch.Generator().manual_seed(5))
    writer = NativeWriter(storage, block_bytes=64)
    wf = writer.write_file(data_file_name("0123456789", 0, 0), [WriteChunk("w", t.dtype, (0, 0), (10, 6), t)])
    return storage, t, wf.chunks[0][1]


def test_rows_of_a_chunk_are_read_as_stored_and_checked(tmp_path):
    storage, t, rec = _saved_matrix(tmp_path)
    got = read_rows(storage, "w", rec, (3, 7), 4)  # bytes 72..168 of the chunk: blocks 1 and 2 of 64 bytes
    assert bytes(got) == t[3:7].numpy().tobytes()
    assert bytes(read_rows(storage, "w", rec, (0, 10), 4)) == t.numpy().tobytes()
    assert bytes(read_rows(storage, "w", rec, (9, 9), 4)) == b""


def test_a_damaged_byte_in_the_rows_read_fails_the_read(tmp_path):
    storage, t, rec = _saved_matrix(tmp_path)
    path = tmp_path / "ck" / rec.file
    data = bytearray(path.read_bytes())
    data[rec.start + 180] ^= 1  # in block 2 (bytes 128-191), past rows 3-7 (bytes 72-167) that end in it
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="checksum block 2 does not match"):
        read_rows(storage, "w", rec, (3, 7), 4)
    assert bytes(read_rows(storage, "w", rec, (0, 2), 4)) == t[:2].numpy().tobytes()  # block 0 is whole


def test_rows_outside_the_chunk_are_refused(tmp_path):
    storage, _, rec = _saved_matrix(tmp_path)
    with pytest.raises(ValueError, match="outside"):
        read_rows(storage, "w", rec, (8, 11), 4)
