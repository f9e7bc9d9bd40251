"""Column strips: column-cut matrices are stored so that a load cutting their columns again reads only
what it needs.

Without strips a chunk is row-major and every checksum block holds bytes of
every column, so a reader that wants a quarter of the columns fetches the
whole chunk.  A chunk whose columns the saved layout cut (tensor
parallelism's ``Shard(1)``; here: each matrix saved as two column halves, as
at tp=2) is stored as strips (format version 2): a reader fetches the strips
its columns fall in, and the strips' checksum blocks span as many rows as the
whole chunk's would, so row cuts read no more than before.  Chunks of whole
rows -- every FSDP checkpoint -- stay row-major and version 1.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from shardkit.checkpoint.formats.base import WriteChunk, read_box
from shardkit.checkpoint.formats.native.checksums import check_chunk
from shardkit.checkpoint.formats.native.manifest_parse import parse_manifest
from shardkit.checkpoint.formats.native.reader import NativeReader
from shardkit.checkpoint.formats.native.writer import NativeWriter, data_file_name, new_token
from shardkit.checkpoint.geometry.strips import strip_boxes, strip_width
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ChecksumMismatch, InvalidManifest

BLOCK = 1024


def _values(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape).sin()


def _column_halves(key: str, t: torch.Tensor) -> list[WriteChunk]:
    if t.dim() < 2:
        return [WriteChunk(key, t.dtype, (0,) * t.dim(), tuple(t.shape), t, tuple(t.shape))]
    half = -(-t.shape[1] // 2)
    return [WriteChunk(key, t.dtype, (0, lo) + (0,) * (t.dim() - 2), (t.shape[0], part.shape[1]) + tuple(t.shape[2:]),
                       part.contiguous(), tuple(t.shape))
            for lo, part in ((0, t[:, :half]), (half, t[:, half:]))]


def _save_whole(url: str, tensors: dict[str, torch.Tensor], *, cut_columns: bool = True,
                **writer_options) -> dict:
    """Each tensor as two column halves (or, ``cut_columns=False``, one chunk), written by one writer;
    returns the manifest as JSON."""
    storage = Storage(url)
    writer = NativeWriter(storage, block_bytes=BLOCK, **writer_options)
    chunks = [c for k, t in tensors.items()
              for c in (_column_halves(k, t) if cut_columns else
                        [WriteChunk(k, t.dtype, (0,) * t.dim(), tuple(t.shape), t, tuple(t.shape))])]
    wf = writer.write_file(data_file_name(new_token(), 0, 0), chunks)
    writer.commit(writer.build_manifest({k: (t.dtype, t.shape) for k, t in tensors.items()}, [wf]))
    return json.loads(storage.read_bytes("manifest.json"))


def _amplification(url: str, key: str, box) -> float:
    with NativeReader(url) as reader:
        got = read_box(reader, key, box)
        assert reader.stats.bytes_needed == got.numel() * got.element_size()
        return reader.stats.bytes_read / reader.stats.bytes_needed


def test_strips_lie_on_the_tensors_grid_and_tile_the_chunk():
    assert strip_boxes(((3, 5), (2, 10)), 1, 4) == [((3, 5), (2, 3)), ((3, 8), (2, 4)), ((3, 12), (2, 3))]
    assert strip_boxes(((0, 0), (4, 8)), 1, 8) == [((0, 0), (4, 8))]
    # a width that divides evenly is chosen when there is one, so power-of-two cuts fall on strip edges
    assert strip_width(4096, (64, 2048), 2, 4096, 16) == 128
    assert strip_width(517, (64, 259), 4, 4096, 16) == 17  # odd: the chunk's width over 16, on the tensor's grid
    assert strip_width(512, (64, 512), 4, 4096, 16) is None  # whole rows (FSDP) stay one row-major run
    assert strip_width(512, (512,), 4, 4096, 16) is None  # vectors stay whole
    assert strip_width(512, (2, 256), 4, 4096, 16) is None  # fits in one block: nothing to gain
    assert strip_width(512, (64, 256), 4, 4096, 0) is None  # strips switched off


def test_a_quarter_of_the_columns_of_an_even_matrix_saved_in_halves_reads_exactly_what_it_needs(tmp_path):
    url = str(tmp_path / "ck")
    full = _values(64, 512)
    _save_whole(url, {"w": full})
    for quarter in range(4):
        box = ((0, quarter * 128), (64, 128))
        assert _amplification(url, "w", box) == 1.0
    with NativeReader(url) as reader:
        assert torch.equal(read_box(reader, "w", ((0, 128), (64, 128))), full[:, 128:256])


def test_column_cuts_of_an_odd_matrix_read_at_most_two_partial_strips_more(tmp_path):
    url = str(tmp_path / "ck")
    full = _values(64, 517)
    _save_whole(url, {"w": full})
    with NativeReader(url) as reader:
        assert torch.equal(read_box(reader, "w", ((0, 130), (64, 129))), full[:, 130:259])
    for lo, hi in [(0, 130), (130, 259), (259, 388), (388, 517)]:
        # strips are 17 columns wide (259 / 16): at most 2 x 16 columns more than the 129 or 130 needed
        assert _amplification(url, "w", ((0, lo), (64, hi - lo))) <= (hi - lo + 32) / (hi - lo)


def test_row_cuts_of_a_striped_matrix_read_no_more_than_row_major_storage(tmp_path):
    full = _values(256, 512)
    rows = ((37, 0), (90, 512))
    striped, whole = str(tmp_path / "striped"), str(tmp_path / "whole")
    _save_whole(striped, {"w": full})
    _save_whole(whole, {"w": full}, column_strips="off")  # the same column halves, row-major
    assert _amplification(striped, "w", rows) <= _amplification(whole, "w", rows) <= 1.1
    with NativeReader(striped) as reader:
        assert torch.equal(read_box(reader, "w", rows), full[37:127])


def test_a_striped_chunk_is_one_manifest_record_of_version_2_and_plain_safetensors_entries(tmp_path):
    url = tmp_path / "ck"
    full, bias = _values(64, 512), _values(512)
    manifest = _save_whole(str(url), {"w": full, "b": bias})
    assert manifest["version"] == 2
    (left, right), (b_chunk,) = manifest["tensors"]["w"]["chunks"], manifest["tensors"]["b"]["chunks"]
    assert left["strips"] == right["strips"] == [1, 16] and "strips" not in b_chunk
    assert left["block"] == BLOCK * 16 // 256  # a block spans as many rows as in the whole chunk
    entries = load_file(str(url / left["file"]))
    strips = [entries[f"{c['key']}#{j}"] for c in (left, right) for j in range(16)]
    assert all(s.shape == (64, 16) for s in strips)
    assert torch.equal(torch.cat(strips, dim=1), full)  # any safetensors reader can put it back together


@pytest.mark.parametrize("options", [{"cut_columns": False}, {"column_strips": "off"}])
def test_chunks_of_whole_rows_or_strips_switched_off_stay_row_major_and_version_1(tmp_path, options):
    manifest = _save_whole(str(tmp_path / "ck"), {"w": _values(64, 512)}, **options)
    assert manifest["version"] == 1 and all("strips" not in c for c in manifest["tensors"]["w"]["chunks"])


def test_compressed_chunks_are_never_striped(tmp_path):
    from shardkit.checkpoint.formats.compression import Compression

    manifest = _save_whole(str(tmp_path / "ck"), {"w": _values(64, 512)}, compression=Compression())
    assert manifest["version"] == 1 and manifest["tensors"]["w"]["chunks"][0]["codec"] == "zstd"


def test_strips_in_a_version_1_manifest_or_malformed_strips_are_refused(tmp_path):
    url = tmp_path / "ck"
    manifest = _save_whole(str(url), {"w": _values(64, 512)})
    for version, strips, message in [(1, [1, 32], "needs format version 2"), (2, [0, 32], "strips dim"),
                                     (2, [1, 0], "strips width"), (2, [1, 600], "strips width"),
                                     (2, "1,32", "must be [dim, width]")]:
        doc = json.loads(json.dumps(manifest))
        doc["version"] = version
        doc["tensors"]["w"]["chunks"][0]["strips"] = strips
        with pytest.raises(InvalidManifest, match=re.escape(message)):
            parse_manifest(json.dumps(doc).encode(), str(url / "manifest.json"))


def test_a_flipped_byte_in_one_strip_is_found_by_the_check_and_refused_by_a_read(tmp_path):
    url = tmp_path / "ck"
    manifest = _save_whole(str(url), {"w": _values(64, 512)})
    chunk = manifest["tensors"]["w"]["chunks"][0]
    storage = Storage(str(url))
    with NativeReader(str(url)) as reader:
        record = reader.manifest.tensors["w"].chunks[0]
        assert check_chunk(storage, record) is None
    strip_bytes = 64 * 16 * 4
    path = url / chunk["file"]
    data = bytearray(path.read_bytes())
    data[chunk["start"] + 5 * strip_bytes + 100] ^= 0x01  # strip 5, its second block
    path.write_bytes(bytes(data))
    blocks_per_strip = strip_bytes // chunk["block"]
    assert check_chunk(storage, record) == 5 * blocks_per_strip + 100 // chunk["block"]
    with NativeReader(str(url)) as reader:
        assert _amplification(str(url), "w", ((0, 0), (64, 64))) == 1.0  # strips 0-3 are intact
        with pytest.raises(ChecksumMismatch, match="checksum block"):
            read_box(reader, "w", ((0, 80), (64, 16)))


def _reader_from_the_format_document():
    """The plain-Python reader of docs/format.md section 9, run as written."""
    from tests.project.test_docs_code import ROOT, python_blocks

    (block,) = [b for b in python_blocks(ROOT / "docs" / "format.md") if "def load_tensor(" in b.code]
    namespace: dict = {}
    exec(block.code, namespace)  # noqa: S102 - our own document's example
    return namespace["load_tensor"]


def test_the_format_documents_reader_reads_striped_and_version_1_checkpoints_without_shardkit(tmp_path):
    from tests.checkpoint.formats.native.test_versions import FIXTURES, expected_state

    load_tensor = _reader_from_the_format_document()
    url = tmp_path / "ck"
    tensors = {"w": _values(64, 517), "v": _values(3, 300, 7), "b": _values(517)}
    manifest = _save_whole(str(url), tensors)
    assert all("strips" in manifest["tensors"][k]["chunks"][0] for k in ("w", "v"))
    for key, tensor in tensors.items():
        assert torch.equal(torch.from_numpy(load_tensor(str(url), key)), tensor), key
    want = expected_state()
    for version, fixture in FIXTURES.items():  # what earlier writers stored, striped (v2) or not (v1)
        for key in ("model.emb.weight", "model.w2.weight", "model.norm.weight"):
            assert torch.equal(torch.from_numpy(load_tensor(str(fixture), key)), want[key]), (version, key)


def test_an_unknown_column_strips_choice_is_refused_before_anything_is_written(tmp_path):
    import shardkit.checkpoint as skc
    from shardkit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="column_strips must be one of cut, all, off"):
        skc.save({"w": _values(4, 4)}, str(tmp_path / "ck"), column_strips="some")
    assert not (tmp_path / "ck").exists()
