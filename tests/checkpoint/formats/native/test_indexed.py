"""Format version 3: chunk records in one index file per writer, writer regions by rule.

A checkpoint with many chunk records keeps them out of ``manifest.json``:
each writer's records go to ``index/<token>-<writer>.json`` (listed in the
manifest with its size and crc32c), and the manifest says per tensor which
writer stored which box -- by a rule (mesh, placements, writer per coordinate)
for the layouts of a sharded job.  A loading rank reads only the index files
of the writers whose regions meet what it loads.  The tests force version 3
on small states (``INDEXED_FROM_CHUNKS = 0``); a real job reaches it at 4096
chunk records.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.support.dist import run_on_ranks

SHAPES = {"model.emb": (101, 64), "model.w": (37, 26), "model.b": (26,), "optim.step": ()}
LAYOUTS = {"fsdp4": ((4,), "S0"), "hsdp2x2": ((2, 2), "R,S0"), "tp2x2": ((2, 2), "S0,S1")}


def truth_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


@contextmanager
def always_indexed():
    """Every save of the block commits version 3 (restored after: rank processes serve later tests)."""
    from shardkit.checkpoint.formats.native import index

    old, index.INDEXED_FROM_CHUNKS = index.INDEXED_FROM_CHUNKS, 0
    try:
        yield
    finally:
        index.INDEXED_FROM_CHUNKS = old


def _placements(kind: str, ndim: int) -> list:
    from torch.distributed.tensor import Replicate, Shard

    parts = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    out = [parts[p] for p in kind.split(",")]
    return [p if not isinstance(p, Shard) or p.dim < ndim else Replicate() for p in out]


def shard_on_mesh(values: dict[str, torch.Tensor], mesh_shape: tuple[int, ...], kind: str) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    return {k: distribute_tensor(v, mesh, _placements(kind, v.ndim)) if v.ndim else v for k, v in values.items()}


def _save(url: str, mesh_shape: tuple[int, ...], kind: str, options: dict | None = None,
          background: bool = False) -> None:
    import shardkit.checkpoint as skc

    state = shard_on_mesh(truth_values(), mesh_shape, kind)
    with always_indexed():
        if background:
            skc.async_save(state, url, storage_options=options, chunk_bytes=1024, block_bytes=512,
                           meta={"step": 7}).result()
        else:
            skc.save(state, url, storage_options=options, chunk_bytes=1024, block_bytes=512, meta={"step": 7})


def _load(url: str, mesh_shape: tuple[int, ...], kind: str, options: dict | None = None
          ) -> tuple[bool, int, list[str]]:
    """(every target bitwise equal, the saved step, the index files this rank read)."""
    import shardkit.checkpoint as skc
    from shardkit.checkpoint.io.storage import Storage

    read_bytes, names = Storage.read_bytes, []

    def counted(self, name, start=None, end=None):
        if name.startswith("index/"):
            names.append(name)
        return read_bytes(self, name, start, end)

    targets = shard_on_mesh({k: torch.zeros(s) for k, s in SHAPES.items()}, mesh_shape, kind)
    Storage.read_bytes = counted
    try:
        meta = skc.load(targets, url, storage_options=options)
    finally:
        Storage.read_bytes = read_bytes
    truth = truth_values()
    same = all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, truth[k]) for k, v in targets.items())
    return same, meta["step"], sorted(names)


def _manifest(url: str | Path) -> dict:
    return json.loads((Path(url) / "manifest.json").read_text())


@pytest.fixture(scope="module")
def fsdp4(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("indexed") / "ck")
    run_on_ranks(4, _save, url, (4,), "S0")
    return url


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_sharded_save_describes_its_layout_by_rule_and_loads_at_another_layout(tmp_path, layout):
    url = str(tmp_path / "ck")
    run_on_ranks(4, _save, url, *LAYOUTS[layout])
    doc = _manifest(url)
    assert doc["version"] == 3 and "files" not in doc
    assert all("chunks" not in t for t in doc["tensors"].values())
    # the sharded tensors share rules; only the plain scalar (rank 0 writes it) is listed
    assert {k for k, t in doc["tensors"].items() if "rule" in t} == {"model.emb", "model.w", "model.b"}
    assert doc["tensors"]["optim.step"]["regions"] == [[0, [], []]]
    assert len(doc["rules"]) <= 2 and all(r["mesh"] == list(LAYOUTS[layout][0]) for r in doc["rules"])
    writers = {i["writer"] for i in doc["indexes"].values()}
    assert writers == ({0, 1, 2, 3} if layout != "hsdp2x2" else {0, 1})  # a replica's shard is written once
    assert sorted(n.split("/")[0] for n in doc["indexes"]) == ["index"] * len(writers)
    assert run_on_ranks(3, _load, url, (3,), "S0")[0][:2] == (True, 7)


def test_a_loading_rank_reads_only_the_index_files_of_the_writers_it_needs(fsdp4):
    results = run_on_ranks(4, _load, fsdp4, (4,), "S0")
    assert all(same and step == 7 for same, step, _ in results)
    for rank, (_, _, names) in enumerate(results):  # its own rows' writer, and rank 0 for the plain scalar
        assert sorted(n.rsplit("-", 1)[1] for n in names) == sorted({"0.json", f"{rank}.json"}), names


def test_focus_reads_the_records_covering_the_wanted_boxes_and_nothing_else(fsdp4):
    from shardkit.checkpoint.formats.base import read_box
    from shardkit.checkpoint.formats.native.reader import NativeReader

    reader = NativeReader(fsdp4)
    box = ((60, 0), (10, 64))  # rows 52..77 are writer 2's (101 rows over 4: 26 each)
    reader.focus({"model.emb": [box]})
    assert not reader.manifest.complete
    files = {c.locator.file for c in reader.tensors()["model.emb"].chunks}
    assert files and all(f.split("-")[1] == "2" for f in files)
    assert reader.tensors()["model.w"].chunks  # writer 2's records of every tensor came with its index file
    assert torch.equal(read_box(reader, "model.emb", box), truth_values()["model.emb"][60:70])


def test_offline_tools_read_every_index_file(fsdp4, tmp_path):
    from shardkit.checkpoint import diff, inspect, reshard, verify

    report = verify(fsdp4)
    assert report.ok and report.bytes_checked >= sum(t.numel() * 4 for t in truth_values().values())
    described = inspect(fsdp4)
    assert described["version"] == 3 and described["layout"]["world_size"] == 4
    assert sum(t["chunks"] for t in described["tensors"]) > 8  # every writer's records, from its index file
    for world in (1, 3):
        out = str(tmp_path / f"ws{world}")
        reshard(fsdp4, out, world_size=world)
        assert diff(fsdp4, out).equal
    loaded = {k: torch.zeros(s) for k, s in SHAPES.items()}
    import shardkit.checkpoint as skc

    skc.load(loaded, fsdp4)
    assert all(torch.equal(loaded[k], v) for k, v in truth_values().items())


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _index_of(url: Path, writer: int) -> Path:
    name = next(n for n, i in _manifest(url)["indexes"].items() if i["writer"] == writer)
    return url / name


def test_a_damaged_or_missing_index_file_fails_the_load_naming_it_and_writes_no_target(fsdp4, tmp_path):
    import shardkit.checkpoint as skc
    from shardkit.errors import CorruptCheckpoint

    damaged = _copy(fsdp4, tmp_path / "damaged")
    path = _index_of(damaged, 1)
    path.write_text(path.read_text().replace('"codec":"raw"', '"codec":"raw" ', 1))
    missing = _copy(fsdp4, tmp_path / "missing")
    _index_of(missing, 3).unlink()
    for url, name, words in ((damaged, path.name, "damaged"), (missing, None, "missing")):
        targets = {k: torch.full(s, 7.0) for k, s in SHAPES.items()}
        with pytest.raises(CorruptCheckpoint, match=words) as info:
            skc.load(targets, str(url))
        assert name is None or name in str(info.value)
        assert all(bool(t.eq(7.0).all()) for t in targets.values())
        report = skc.verify(str(url))
        assert not report.ok and words in " ".join(report.problems)


def test_an_index_file_that_disagrees_with_the_manifests_regions_is_refused(fsdp4, tmp_path):
    import shardkit.checkpoint as skc
    from shardkit.errors import InvalidManifest

    url = _copy(fsdp4, tmp_path / "swapped")
    doc = _manifest(url)
    rule = doc["rules"][doc["tensors"]["model.emb"]["rule"]]
    rule["writers"][1], rule["writers"][2] = rule["writers"][2], rule["writers"][1]
    (url / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(InvalidManifest, match="disagree"):
        skc.load({k: torch.zeros(s) for k, s in SHAPES.items()}, str(url))


@pytest.mark.parametrize("edit,words", [
    (lambda d: d["rules"][0]["placements"].__setitem__(0, ["shard", 5]), "shards a dimension"),
    (lambda d: d["rules"][0]["writers"].__setitem__(1, 9), "no index file"),
    (lambda d: d["rules"][0]["writers"].__setitem__(1, 0), "disagree|same box"),
    (lambda d: d["tensors"]["optim.step"].__setitem__("regions", [[0, [], []], [1, [], []]]), "same box|stored more"),
    (lambda d: d["indexes"].__setitem__("../x.json", {"size": 1, "crc32c": "AAAAAA==", "writer": 7}), "x.json"),
    (lambda d: d["rules"][0].__setitem__("mesh", [0]), "mesh"),
], ids=["dim", "writer-without-index", "writer-moved", "scalar-twice", "bad-name", "empty-mesh"])
def test_a_damaged_version_3_manifest_is_refused_with_one_clear_error(fsdp4, tmp_path, edit, words):
    import shardkit.checkpoint as skc
    from shardkit.errors import ShardkitError

    url = _copy(fsdp4, tmp_path / "edited")
    doc = _manifest(url)
    edit(doc)
    (url / "manifest.json").write_text(json.dumps(doc))
    targets = {k: torch.full(s, 7.0) for k, s in SHAPES.items()}
    with pytest.raises(ShardkitError, match=words):
        skc.load(targets, str(url))
    assert all(bool(t.eq(7.0).all()) for t in targets.values())


def test_a_save_that_dies_before_its_manifest_keeps_the_old_checkpoint_and_the_next_removes_its_index_files(
        tmp_path, monkeypatch):
    import shardkit.checkpoint as skc
    from shardkit.checkpoint.io.storage import Storage

    url = tmp_path / "ck"
    old = {"w": torch.arange(3000.0)}
    with always_indexed():
        skc.save(old, str(url), chunk_bytes=1024)
        (url / "index" / "notes.txt").write_text("mine")  # not shardkit's: never touched
        before = set((url / "index").iterdir())
        put_atomic = Storage.put_atomic

        def die_at_commit(self, name, data):
            if name == "manifest.json":
                raise OSError("killed")
            return put_atomic(self, name, data)

        monkeypatch.setattr(Storage, "put_atomic", die_at_commit)
        monkeypatch.setattr(Storage, "delete", lambda self, names: None)  # killed: it cleans nothing up
        with pytest.raises(Exception):
            skc.save({"w": torch.zeros(3000)}, str(url), chunk_bytes=1024)
        monkeypatch.undo()
        assert set((url / "index").iterdir()) > before  # the dead save's index file is there, unreferenced
        loaded = {"w": torch.zeros(3000)}
        skc.load(loaded, str(url))
        assert torch.equal(loaded["w"], old["w"])
        skc.save({"w": torch.ones(3000)}, str(url), chunk_bytes=1024)
    names = {p.name for p in (url / "index").iterdir()}
    assert names == {"notes.txt", *(n.split("/")[1] for n in _manifest(url)["indexes"])}


def test_retention_removes_the_index_files_of_a_dropped_step(tmp_path):
    import shardkit.checkpoint as skc

    root = tmp_path / "run"
    with always_indexed():
        manager = skc.CheckpointManager(str(root), keep_last=1)
        manager.save(1, torch.nn.Linear(40, 40))
        assert list((root / "step-0000000001" / "index").iterdir())
        manager.save(2, torch.nn.Linear(40, 40))
    assert manager.steps() == [2] and [p.name for p in root.iterdir()] == ["step-0000000002"]


def test_on_s3_a_background_save_commits_index_files_a_later_save_replaces_them_and_three_ranks_load(s3_url):
    import s3fs

    root, options = s3_url
    url = f"{root}/indexed/ck"
    run_on_ranks(2, _save, url, (2,), "S0", options, True)
    fs = s3fs.S3FileSystem(**options)
    first = set(fs.ls(f"{url}/index", refresh=True))
    assert len(first) == 2 and _s3_manifest(fs, url)["version"] == 3
    run_on_ranks(2, _save, url, (2,), "S0", options, False)
    second = set(fs.ls(f"{url}/index", refresh=True))
    assert len(second) == 2 and not first & second  # the old index files went after the new commit
    results = run_on_ranks(3, _load, url, (3,), "S0", options)
    assert all(same and step == 7 and names for same, step, names in results)


def _s3_manifest(fs, url: str) -> dict:
    return json.loads(fs.cat_file(f"{url}/manifest.json"))


def test_an_offline_reshard_writes_version_3_by_rule_and_a_loading_rank_reads_its_writers_only(fsdp4, tmp_path):
    from shardkit.checkpoint import diff, reshard

    out = str(tmp_path / "ws4")
    with always_indexed():
        reshard(fsdp4, out, world_size=4)  # the offline writer: row range i of every tensor is writer i's
    doc = _manifest(out)
    assert doc["version"] == 3 and doc["rules"] == [{"mesh": [4], "placements": [["shard", 0]],
                                                      "writers": [0, 1, 2, 3]}]
    assert diff(fsdp4, out).equal
    results = run_on_ranks(4, _load, out, (4,), "S0")
    assert all(same for same, _, _ in results)
    assert [len(names) for _, _, names in results] == [1, 2, 2, 2]  # its rows' writer, and 0 for the scalar


def test_a_directory_where_an_index_file_would_be_does_not_turn_a_committed_save_into_a_failed_one(tmp_path):
    import shardkit.checkpoint as skc

    url = tmp_path / "ck"
    with always_indexed():
        skc.save({"w": torch.zeros(3000)}, str(url), chunk_bytes=1024)
        (url / "index" / "0123456789-7.json").mkdir()  # named like shardkit's, but not a file: cleanup cannot take it
        skc.save({"w": torch.ones(3000)}, str(url), chunk_bytes=1024)
    loaded = {"w": torch.zeros(3000)}
    skc.load(loaded, str(url))
    assert torch.equal(loaded["w"], torch.ones(3000))


def test_the_managers_input_state_targets_need_no_index_file(fsdp4):
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.checkpoint.training.input_state import stored_input_state

    read_bytes, names = Storage.read_bytes, []

    def counted(self, name, start=None, end=None):
        names.append(name)
        return read_bytes(self, name, start, end)

    Storage.read_bytes = counted
    try:
        assert stored_input_state(fsdp4) == {}
    finally:
        Storage.read_bytes = read_bytes
    assert names == ["manifest.json"]


def test_an_offline_reshard_onto_a_replicated_mesh_describes_its_writers_by_rule(fsdp4, tmp_path):
    from shardkit.checkpoint import diff, reshard

    out = str(tmp_path / "hsdp")
    with always_indexed():
        reshard(fsdp4, out, world_size=4, mesh=(2, 2))  # two replicas of two row ranges: writers 0 and 1
    doc = _manifest(out)
    assert doc["rules"] == [{"mesh": [2], "placements": [["shard", 0]], "writers": [0, 1]}]
    assert diff(fsdp4, out).equal
