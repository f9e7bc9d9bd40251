"""A version-3 save whose writers each write their own index file: rank 0 commits from summaries.

Each writer checks its chunks against its regions and writes
``index/<token>-<writer>.json`` itself; rank 0 gathers one summary per writer
(regions as claims on the layout's mesh, file names and sizes, the index
file's size and crc32c) and never a chunk record.  A reader checks each index
file's size and crc32c before parsing it.  Version 3 is forced on a small
state with ``INDEXED_FROM_CHUNKS`` lowered, as in ``test_format_indexed.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.dist import run_on_ranks

SHAPES = {"model.emb": (101, 64), "model.w": (37, 26), "optim.step": ()}


def _truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _sharded(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: distribute_tensor(v, mesh, [Shard(0)]) if v.ndim else v for k, v in values.items()}


def _records_in(value) -> int:
    """How many chunk records (objects with ``offsets`` and ``crc32c``) a JSON value holds."""
    if isinstance(value, dict):
        return int({"offsets", "crc32c"} <= set(value)) + sum(_records_in(v) for v in value.values())
    if isinstance(value, list):
        return sum(_records_in(v) for v in value)
    return 0


def _save(url: str, chunk_bytes: int) -> list[int] | None:
    """Save on every rank with version 3 forced; on rank 0, the chunk records in each rank's gathered payload
    and the payloads' sizes (numbers zeroed)."""
    import shardkit.checkpoint as skc
    from shardkit.checkpoint.formats.native import index
    from shardkit.checkpoint.io.dist import Dist

    gathered: list = []
    gather_json = Dist.gather_json

    def recorded(self, obj, dst=0, **how):
        found = gather_json(self, obj, dst, **how)
        if found is not None:
            gathered.extend(found)
        return found

    old, index.INDEXED_FROM_CHUNKS = index.INDEXED_FROM_CHUNKS, 0
    Dist.gather_json = recorded
    try:
        skc.save(_sharded(_truth()), url, chunk_bytes=chunk_bytes, block_bytes=512, meta={"step": 3})
    finally:
        Dist.gather_json, index.INDEXED_FROM_CHUNKS = gather_json, old
    if not gathered:
        return None
    return [_records_in(g) for g in gathered] + [len(json.dumps(_without_numbers(g))) for g in gathered]


def _without_numbers(payload: dict) -> dict:
    """A gathered payload with its numbers zeroed (file sizes and crc32c vary with the data, not the chunks)."""
    summary = payload.get("summary")
    if summary is None:
        return payload
    return {**payload, "summary": {**summary, "record": [0, 0], "files": {n: 0 for n in summary["files"]}}}


def _load(url: str) -> bool:
    import shardkit.checkpoint as skc

    targets = _sharded({k: torch.zeros(s) for k, s in SHAPES.items()})
    skc.load(targets, url)
    truth = _truth()
    return all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, truth[k]) for k, v in targets.items())


def _manifest(url: str | Path) -> dict:
    return json.loads((Path(url) / "manifest.json").read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[int], list[int]]:
    """A 4-rank save cut into 2 KiB chunks and one cut into 1 KiB chunks, with what rank 0 gathered."""
    root = tmp_path_factory.mktemp("per-writer")
    coarse = run_on_ranks(4, _save, str(root / "coarse"), 2048)[0]
    fine = run_on_ranks(4, _save, str(root / "ck"), 1024)[0]
    return str(root / "ck"), coarse, fine


def _index_file(url: str | Path, writer: int) -> Path:
    name = next(n for n, i in _manifest(url)["indexes"].items() if i["writer"] == writer)
    return Path(url) / name


def test_rank_0_gathers_no_chunk_record_and_the_same_bytes_whatever_the_number_of_chunks(saved):
    url, coarse, fine = saved
    assert coarse[:4] == [0, 0, 0, 0] and fine[:4] == [0, 0, 0, 0]
    assert coarse[4:] == fine[4:]  # about twice the chunks, not one byte more gathered
    for where, per_writer in ((url, [7, 7, 7, 6]), (str(Path(url).parent / "coarse"), [4, 4, 4, 3])):
        stored = [json.loads(_index_file(where, w).read_text())["chunks"]["model.emb"] for w in range(4)]
        assert [len(records) for records in stored] == per_writer  # 26 rows (23 for the last) of 256 bytes


def _written_by_each_writer(url: str | Path) -> bool:
    """Whether every index file carries the name of its writer's data files (each writer names its files
    with a token of its own; index files written on one rank at commit share one token)."""
    indexes = _manifest(url)["indexes"]
    tokens = {name.split("/")[1].split("-")[0] for name in indexes}
    return len(tokens) == len(indexes) == 4 and all(
        f.startswith(f"data/{name.split('/')[1].split('-')[0]}-{info['writer']}-")
        for name, info in indexes.items() for f in json.loads((Path(url) / name).read_text())["files"])


def test_each_writer_wrote_its_own_index_file_and_the_manifest_names_them_by_rule(saved):
    url = saved[0]
    doc = _manifest(url)
    assert doc["version"] == 3 and doc["rules"] == [{"mesh": [4], "placements": [["shard", 0]],
                                                      "writers": [0, 1, 2, 3]}]
    assert doc["tensors"]["model.emb"]["rule"] == 0 and doc["tensors"]["optim.step"]["regions"] == [[0, [], []]]
    assert _written_by_each_writer(url)
    for name, info in doc["indexes"].items():
        assert json.loads((Path(url) / name).read_text())["writer"] == info["writer"]


def test_a_checkpoint_of_per_writer_index_files_loads_at_two_ranks_and_in_one_process_bitwise(saved):
    url = saved[0]
    assert _written_by_each_writer(url)
    assert run_on_ranks(2, _load, url) == [True, True]
    loaded = {k: torch.zeros(s) for k, s in SHAPES.items()}
    import shardkit.checkpoint as skc

    skc.load(loaded, url)
    assert all(torch.equal(loaded[k], v) for k, v in _truth().items())


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


@pytest.mark.parametrize("damage,words", [(_flip_a_byte, "damaged"), (_truncate, "damaged"),
                                          (Path.unlink, "missing")], ids=["flipped-byte", "truncated", "missing"])
def test_a_damaged_or_missing_per_writer_index_file_fails_the_load_naming_it(saved, tmp_path, damage, words):
    import shardkit.checkpoint as skc
    from shardkit.errors import CorruptCheckpoint

    url = tmp_path / "ck"
    shutil.copytree(saved[0], url)
    assert _written_by_each_writer(url)
    path = _index_file(url, 2)
    damage(path)
    targets = {k: torch.full(s, 7.0) for k, s in SHAPES.items()}
    with pytest.raises(CorruptCheckpoint, match=words) as info:
        skc.load(targets, str(url))
    assert f"index/{path.name}" in str(info.value)


def test_a_writer_whose_chunks_do_not_tile_its_regions_writes_no_index_file(tmp_path):
    from shardkit.checkpoint.formats.native.manifest import ChunkRecord
    from shardkit.checkpoint.formats.native.summaries import write_index
    from shardkit.checkpoint.formats.native.writer import WrittenFile
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.errors import CheckpointError

    half = ChunkRecord((0, 0), (4, 8), "data/abc-1-0.safetensors", "w@0,0", 100, 128, "raw", 512, (0,))
    files = [WrittenFile("data/abc-1-0.safetensors", 228, 1, (("model.w", half),))]
    with pytest.raises(CheckpointError, match="writer 1's chunks of 'model.w' do not tile"):
        write_index(Storage(str(tmp_path)), "abc", 1, files, {"model.w": (((0, 0), (8, 8)),)})
    assert not (tmp_path / "index").exists()


def _summaries(claimed: dict[int, int], files: dict[int, str]) -> list:
    """Summaries of writers (writer -> claimed coordinate on a 4-rank ``Shard(0)`` mesh, writer -> data file)."""
    from shardkit.checkpoint.formats.native.manifest import IndexRecord
    from shardkit.checkpoint.formats.native.summaries import WriterSummary

    return [WriterSummary(w, f"index/0123456789-{w}.json", IndexRecord(10, 0, w), {files[w]: 100},
                          ((0, (coord,)),)) for w, coord in claimed.items()]


def _commit_summaries(summaries: list):
    from shardkit.checkpoint.formats.native.summaries import manifest_from_summaries

    return manifest_from_summaries({"model.emb": ("F32", (101, 64))}, [((4,), (("shard", 0),), ("model.emb",))],
                                   summaries, values={}, meta={}, writer_info={}, aliases={}, where="save to x")


def test_rank_0_makes_one_rule_of_the_writers_claims_and_keeps_their_files():
    manifest, kept = _commit_summaries(_summaries({0: 0, 1: 1, 2: 2, 3: 3}, {w: f"data/abc-{w}-0.safetensors"
                                                                           for w in range(4)}))
    assert manifest.rules == (((4,), (("shard", 0),), (0, 1, 2, 3)),) and manifest.regions == {"model.emb": 0}
    assert kept == {f"data/abc-{w}-0.safetensors" for w in range(4)} | {f"index/0123456789-{w}.json" for w in range(4)}


@pytest.mark.parametrize("claimed,files,words", [
    ({0: 0, 1: 1, 3: 3}, {0: "data/a-0-0.safetensors", 1: "data/a-1-0.safetensors", 3: "data/a-3-0.safetensors"},
     r"'model.emb' do not tile it: no writer stored the box at \[52, 0\]"),
    ({0: 0, 1: 1, 2: 2, 3: 3}, {0: "data/a-0-0.safetensors", 1: "data/a-0-0.safetensors",
                                2: "data/a-2-0.safetensors", 3: "data/a-3-0.safetensors"},
     "two writers name the data file data/a-0-0.safetensors"),
], ids=["a-box-nobody-stored", "a-file-named-twice"])
def test_rank_0_refuses_summaries_that_leave_a_hole_or_name_a_file_twice(claimed, files, words):
    from shardkit.errors import CheckpointError

    with pytest.raises(CheckpointError, match=words):
        _commit_summaries(_summaries(claimed, files))
