"""The native format's building blocks: layout, planning, the container, the reader and writer."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch.distributed.tensor import Shard

from shardkit.checkpoint.formats.base import (
    StoredChunk,
    WriteChunk,
    plan_reads,
    read_box,
)
from shardkit.checkpoint.formats.compression import Compression
from shardkit.checkpoint.formats.crc32c import BlockCrc, block_crcs, crc32c
from shardkit.checkpoint.formats.native.reader import NativeReader
from shardkit.checkpoint.formats.native.writer import NativeWriter, data_file_name, new_token
from shardkit.checkpoint.formats.safetensors import parse_safetensors_header
from shardkit.checkpoint.geometry.boxes import check_cover, shard_box, split_box
from shardkit.checkpoint.geometry.plan import (
    ChunkIndex,
    byte_runs,
    plan_box,
)
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CorruptCheckpoint, IncompatibleStateDict, UnsafeCheckpoint


def _write_rowwise(url, tensors, row_splits, *, compression=None, block=64, cap=96):
    """Store each tensor split by rows over writers, sub-chunked at ``cap`` bytes."""
    storage = Storage(url)
    writer = NativeWriter(storage, compression=compression, block_bytes=block)
    files = []
    for rank in range(row_splits):
        chunks = []
        for fqn, t in tensors.items():
            n = t.shape[0] if t.dim() else 1
            if t.dim() == 0:
                if rank == 0:
                    chunks.append(WriteChunk(fqn, t.dtype, (), (), t))
                continue
            box = shard_box(t.shape, (row_splits,), (rank,), [Shard(0)])
            for off, shape in split_box(box, t.element_size(), cap):
                if 0 in shape or n == 0:
                    continue
                index = tuple(slice(o, o + s) for o, s in zip(off, shape))
                chunks.append(WriteChunk(fqn, t.dtype, off, shape, t[index].contiguous()))
        files.append(writer.write_file(data_file_name(new_token(), rank, 0), chunks, rank))
    manifest = writer.build_manifest({k: (v.dtype, v.shape) for k, v in tensors.items()}, files,
                                     values={"lr": 0.5}, meta={"step": 7}, writer_info={"world_size": row_splits})
    writer.commit(manifest)
    return manifest


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(11, 7, generator=gen),
        "b16": torch.randn(5, 3, 2, generator=gen).to(torch.bfloat16),
        "i": torch.arange(13, dtype=torch.int64),
        "step": torch.tensor(4.0),
        "empty": torch.empty(0, 3),
    }


@pytest.mark.parametrize("compression", [None, Compression("zstd", 3)], ids=["raw", "zstd"])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_any_sub_box_reads_back_bitwise_from_row_split_chunks(tmp_path, where, compression):
    url = str(tmp_path / "ck") if where == "local" else f"memory://fmt-{new_token()}"
    tensors = _tensors()
    _write_rowwise(url, tensors, 3, compression=compression)
    rng = random.Random(1)
    with NativeReader(url) as reader:
        assert reader.info.meta == {"step": 7} and reader.values() == {"lr": 0.5} and reader.info.world_size == 3
        for fqn, t in tensors.items():
            assert torch.equal(read_box(reader, fqn), t), fqn
        w = tensors["w"]
        for _ in range(40):
            o0, o1 = rng.randrange(11), rng.randrange(7)
            s0, s1 = rng.randrange(1, 12 - o0), rng.randrange(1, 8 - o1)
            out = read_box(reader, "w", ((o0, o1), (s0, s1)))
            assert torch.equal(out, w[o0:o0 + s0, o1:o1 + s1])
        wide = torch.zeros(11, 14)
        read_box(reader, "w", None, wide[:, ::2])  # a strided destination
        assert torch.equal(wide[:, ::2], w) and not wide[:, 1::2].any()


def test_row_range_reads_fetch_only_the_checksum_blocks_they_cover(tmp_path):
    t = torch.arange(4096, dtype=torch.float32).reshape(256, 16)  # 64 bytes per row
    _write_rowwise(str(tmp_path / "ck"), {"t": t}, 1, block=256, cap=1 << 20)
    with NativeReader(str(tmp_path / "ck")) as reader:
        out = read_box(reader, "t", ((100, 0), (50, 16)))
        assert torch.equal(out, t[100:150])
        # 3200 bytes needed; widened to whole 256-byte blocks: at most one extra block per end
        assert reader.stats.bytes_needed == 3200
        assert 3200 <= reader.stats.bytes_read <= 3200 + 2 * 256


def test_data_files_are_plain_safetensors_with_recorded_checksums(tmp_path):
    tensors = _tensors()
    manifest = _write_rowwise(str(tmp_path / "ck"), tensors, 2)
    for name in manifest.files:
        path = tmp_path / "ck" / name
        raw = path.read_bytes()
        header = parse_safetensors_header(raw[:4096], len(raw), name)
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                entry = header.entries[key]
                data = f.get_tensor(key)
                assert data.numel() * data.element_size() == entry.end - entry.start
    rec = manifest.tensors["w"].chunks[0]
    raw = (tmp_path / "ck" / rec.file).read_bytes()[rec.start:rec.start + rec.nbytes]
    assert list(rec.crc32c) == block_crcs(torch.frombuffer(bytearray(raw), dtype=torch.uint8), rec.block)
    doc = json.loads((tmp_path / "ck" / "manifest.json").read_bytes())
    assert doc["format"] == "shardkit" and doc["version"] == 1 and doc["meta"] == {"step": 7}


def test_crc32c_matches_the_reference_implementation():
    import google_crc32c

    data = bytes(range(256)) * 513
    assert crc32c(data) == google_crc32c.value(data)
    assert crc32c(data[1000:], crc32c(data[:1000])) == google_crc32c.value(data)


@pytest.mark.parametrize("fold", ["awscrt", "libcrc32c"])
def test_every_crc32c_backend_agrees_with_the_reference_on_tensors_blocks_and_odd_lengths(fold, monkeypatch):
    import google_crc32c

    from shardkit.checkpoint.formats import crc32c as module

    extend = module.awscrt_extend() if fold == "awscrt" else module.libcrc32c_extend()
    assert extend is not None, f"{fold} is a declared dependency"
    monkeypatch.setattr(module, "_crc_extend_ptr", extend)  # the backend every checksum goes through
    data = torch.arange(3 * 65536 + 7, dtype=torch.int64).to(torch.uint8)
    raw = bytes(data.numpy())
    assert module.crc32c(data) == google_crc32c.value(raw)
    assert module.crc32c(data.view(torch.uint8)[5:], module.crc32c(raw[:5])) == google_crc32c.value(raw)
    assert module.crc32c(torch.ones(9, dtype=torch.bfloat16)) == google_crc32c.value(
        bytes(torch.ones(9, dtype=torch.bfloat16).view(torch.uint8).numpy()))
    block = 65536
    expected = [google_crc32c.value(raw[i:i + block]) for i in range(0, len(raw), block)]
    acc = module.BlockCrc(block)
    for piece in data.split(1000):  # pieces that straddle block edges
        acc.update(piece)
    assert acc.finish() == expected
    for buffer in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8)):  # continuing a value
        assert module.crc32c(buffer, 12345) == google_crc32c.extend(12345, raw)
    for empty in (b"", torch.empty(0, dtype=torch.uint8)):
        assert module.crc32c(empty, 77) == 77


def test_crc32c_refuses_a_strided_array_as_it_refuses_a_strided_tensor():
    # a strided array's bytes in memory order are not its elements in order (a reversed view even starts
    # before its first element's bytes): checksumming them would give a wrong value, or read out of bounds
    for strided in (np.arange(100, dtype=np.uint8)[::-1], np.arange(100, dtype=np.uint8)[::2]):
        with pytest.raises(ValueError, match="non-contiguous"):
            crc32c(strided)
        with pytest.raises(ValueError, match="non-contiguous"):
            BlockCrc(16).update(strided)
    with pytest.raises(ValueError, match="non-contiguous"):
        crc32c(torch.arange(10, dtype=torch.uint8)[::2])


def test_split_box_pieces_tile_the_box_and_respect_the_cap():
    for shape, cap in [((10, 7), 96), ((3, 5, 9), 40), ((1, 1000), 64), ((4,), 4), ((6, 2), 1 << 20)]:
        box = ((2,) * len(shape), shape)
        pieces = split_box(box, 4, cap)
        assert all(torch.Size(p[1]).numel() * 4 <= max(cap, 4) for p in pieces)
        shifted = [(tuple(o - 2 for o in p[0]), p[1]) for p in pieces]
        assert check_cover(shape, shifted) is None
        # row-major order: byte offsets increase piece after piece
        starts = [byte_runs(((0,) * len(shape), shape), p, 4)[0, 0] for p in shifted]
        assert starts == sorted(starts)


def test_cover_check_names_holes_and_overlaps():
    assert check_cover((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
    assert "overlap" in check_cover((4, 4), [((0, 0), (3, 4)), ((2, 0), (1, 4))])
    assert "elements" in check_cover((4, 4), [((0, 0), (3, 4))])
    assert "outside" in check_cover((4, 4), [((0, 0), (5, 4))])


def test_plan_box_finds_exactly_the_overlapping_chunks_and_refuses_holes():
    boxes = [((r, 0), (3, 8)) for r in range(0, 30, 3)]
    index = ChunkIndex(boxes)
    pieces = plan_box(index, ((4, 2), (10, 3)), "t")
    assert [p.chunk for p in pieces] == [1, 2, 3, 4]
    assert sum(p.box[1][0] for p in pieces) == 10
    with pytest.raises(CorruptCheckpoint, match="cover"):
        plan_box(ChunkIndex(boxes[:5]), ((10, 0), (10, 8)), "t")


def test_byte_runs_of_a_sub_box_are_its_rows_inside_the_chunk():
    runs = byte_runs(((0, 0), (8, 16)), ((2, 4), (3, 4)), 4)  # three 16-byte runs, 64 bytes apart
    assert runs.tolist() == [[144, 160], [208, 224], [272, 288]]


def test_reads_refuse_wrong_dtype_and_boxes_outside_the_tensor(tmp_path):
    _write_rowwise(str(tmp_path / "ck"), {"w": torch.zeros(4, 4)}, 1)
    with NativeReader(str(tmp_path / "ck")) as reader:
        with pytest.raises(IncompatibleStateDict, match="float64"):
            plan_reads(reader, [("w", ((0, 0), (4, 4)), torch.zeros(4, 4, dtype=torch.float64))])
        with pytest.raises(IncompatibleStateDict, match="outside"):
            plan_reads(reader, [("w", ((2, 0), (4, 4)), torch.zeros(4, 4))])


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "s3://b/k", "data/../../x", "a\\b", "", "data//x"])
def test_storage_refuses_names_outside_the_checkpoint(tmp_path, name):
    with pytest.raises(UnsafeCheckpoint):
        Storage(str(tmp_path)).path(name)


def test_stored_chunk_locators_do_not_affect_planning():
    chunk = StoredChunk((0,), (3,), locator={"file": "x"})
    assert chunk.box == ((0,), (3,))


def test_direct_io_writer_produces_exact_bytes_for_odd_sized_pieces(tmp_path):
    from shardkit.checkpoint.io import direct_io

    rng = random.Random(5)
    pieces = [bytes(rng.randrange(256) for _ in range(n)) for n in (1, 4095, 4097, 3, 9 << 20, 0, 12345)]
    f = direct_io.open_direct(str(tmp_path / "x.bin"))
    assert f is not None, "the test directory's filesystem should support O_DIRECT (ext4 does)"
    for p in pieces:
        f.write(p)
    f.close(fsync=True)
    assert (tmp_path / "x.bin").read_bytes() == b"".join(pieces)


def test_saves_fall_back_to_buffered_writes_where_direct_io_is_unavailable(tmp_path, monkeypatch):
    from shardkit.checkpoint.io import direct_io

    monkeypatch.setattr(direct_io, "open_direct", lambda path: None)
    tensors = _tensors()
    _write_rowwise(str(tmp_path / "ck"), tensors, 2)
    with NativeReader(str(tmp_path / "ck")) as reader:
        assert all(torch.equal(read_box(reader, k), v) for k, v in tensors.items())


def test_the_checking_pass_reads_bounded_spans_and_each_block_once_writing_nothing(tmp_path, monkeypatch):
    import shardkit.checkpoint as skc
    from shardkit.checkpoint.formats.native import reader as native

    monkeypatch.setattr(native, "CHECK_SPAN", 64 << 10)
    w = torch.randn(100_000)  # 400 kB in chunks of 160 kB, checksum blocks of 4 kB (a vector: no column strips)
    skc.save({"w": w}, str(tmp_path / "c"), chunk_bytes=160_000, block_bytes=4096)
    reads: list[tuple[int, int]] = []
    original = Storage.read_parts

    def record(self, name, start, parts):
        reads.append((start, sum(p.numel() for p in parts)))
        return original(self, name, start, parts)

    monkeypatch.setattr(Storage, "read_parts", record)
    reader = NativeReader(str(tmp_path / "c"))
    out = torch.zeros(100_000)
    requests = plan_reads(reader, [("w", ((0,), (100_000,)), out)])
    reader.verify(requests)
    assert torch.count_nonzero(out) == 0  # nothing written
    assert max(n for _, n in reads) == 64 << 10 and len(reads) == 8  # chunks of 160, 160, 80 kB
    assert sum(n for _, n in reads) == 400_000


def test_check_chunk_finds_the_first_bad_block_with_one_ranged_read_per_span(monkeypatch):
    import fsspec

    import shardkit.checkpoint as skc
    from shardkit.checkpoint.formats.native.checksums import check_chunk

    url = "memory://check-chunk"
    skc.save({"w": torch.randn(100_000)}, url, block_bytes=4096)  # one chunk of 400 kB: 98 blocks
    storage = Storage(url)
    rec = NativeReader(storage).manifest.tensors["w"].chunks[0]
    calls: list[int] = []
    original = Storage.read_parts
    monkeypatch.setattr(Storage, "read_parts",
                        lambda self, name, start, parts: calls.append(sum(p.numel() for p in parts))
                        or original(self, name, start, parts))
    seen: list[int] = []
    assert check_chunk(storage, rec, span=128 << 10, on_bytes=seen.append) is None
    assert calls == [128 << 10] * 3 + [400_000 - 3 * (128 << 10)] and sum(seen) == 400_000
    fs = fsspec.filesystem("memory")
    data = bytearray(fs.cat_file(f"{url}/{rec.file}"))
    data[rec.start + 50 * 4096 + 17] ^= 0x04
    fs.pipe(f"{url}/{rec.file}", bytes(data))
    assert check_chunk(storage, rec) == 50
    assert check_chunk(storage, rec, 0, 50 * 4096) is None and check_chunk(storage, rec, 51 * 4096) is None
    with pytest.raises(ValueError, match="whole checksum blocks"):
        check_chunk(storage, rec, 100)
    fs.rm(url, recursive=True)


def test_shard_range_follows_torch_chunk_and_needs_no_torch_distributed():
    import subprocess
    import sys

    from shardkit.checkpoint.geometry.boxes import shard_range

    for n in range(12):
        for k in range(1, 5):
            pieces = torch.arange(n).chunk(k) if n else ()
            for i in range(k):
                lo, hi = shard_range(n, k, i)
                assert list(range(lo, hi)) == (pieces[i].tolist() if i < len(pieces) else []), (n, k, i)
    probe = ("import sys, torch; from shardkit.checkpoint.geometry.boxes import is_dtensor, shard_range; "
             "assert not is_dtensor(torch.zeros(1)) and shard_range(5, 2, 1) == (3, 5); "
             "assert 'torch.distributed.tensor' not in sys.modules")
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_group_into_files_balances_by_bytes_or_fills_up_to_the_cap():
    from types import SimpleNamespace

    from shardkit.checkpoint.formats.native.writer import group_into_files

    items = [SimpleNamespace(nbytes=n) for n in (5, 5, 5, 5, 30, 1)]
    assert [[c.nbytes for c in g] for g in group_into_files(items, 2, None)] == [[5, 5, 5, 5], [30, 1]]
    assert [[c.nbytes for c in g] for g in group_into_files(items, 99, 10)] == [[5, 5], [5, 5], [30], [1]]
    assert group_into_files([], 3, None) == []
