"""Bad input: every damaged or hostile checkpoint raises a ShardkitError naming the problem, and
nothing is half-loaded.  Includes a seeded mutation fuzz over the manifest and the data files, and
a load of every fixture with pickle made to raise."""

from __future__ import annotations

import copy
import json
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import shardkit.checkpoint as skc
from shardkit.checkpoint.formats.native.manifest import VERSION
from shardkit.checkpoint.formats.native.manifest_parse import parse_manifest
from shardkit.errors import (
    CheckpointNotFound,
    ChecksumMismatch,
    ConfigurationError,
    CorruptCheckpoint,
    IncompatibleStateDict,
    InvalidManifest,
    ShardkitError,
    UnsafeCheckpoint,
    UnsupportedVersion,
)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(33, 21)
        self.b = nn.Linear(21, 9, bias=False)
        self.register_buffer("count", torch.arange(5, dtype=torch.int64))


def _trained(seed: int = 0) -> tuple[_Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    net.b(net.a(torch.randn(4, 33))).sum().backward()
    opt.step()
    return net, opt


def _state(net: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict:
    return skc.get_training_state(net, opt)


def _snapshot(sd: dict) -> dict[str, torch.Tensor]:
    from shardkit.checkpoint.state.tree import flatten

    return {k: v.clone() for k, v in flatten(sd).tensors.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A checkpoint of several chunks in several files, and the state it holds."""
    root = tmp_path_factory.mktemp("bad")
    net, opt = _trained()
    sd = _state(net, opt)
    skc.save(sd, str(root / "ckpt"), chunk_bytes=1024, block_bytes=256, meta={"step": 1})
    return root / "ckpt", _snapshot(sd)


def _copy(pristine_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine_dir, dst)
    return dst


def _fresh_target(seed: int = 5) -> tuple[_Net, torch.optim.Optimizer, dict, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.5)
    sd = _state(net, opt)
    return net, opt, sd, _snapshot(sd)


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_bytes())


def _write_manifest(path: Path, doc: dict) -> None:
    (path / "manifest.json").write_text(json.dumps(doc))


def _data_files(path: Path) -> list[Path]:
    return sorted((path / "data").iterdir())


# --------------------------------------------------------------------------
# keys, shapes, dtypes


def test_missing_keys_raise_when_strict_and_load_the_rest_when_not(pristine, tmp_path):
    ckpt = _copy(pristine[0], tmp_path)
    net, opt, sd, before = _fresh_target()
    sd["model"]["extra_param"] = torch.zeros(3)
    before = _snapshot(sd)
    with pytest.raises(IncompatibleStateDict, match="model.extra_param"):
        skc.load(sd, str(ckpt))
    assert _same(_snapshot(sd), before)  # nothing written
    skc.load(sd, str(ckpt), strict=False)
    assert torch.equal(sd["model"]["a.weight"], pristine[1]["model.a.weight"])
    assert torch.equal(sd["model"]["extra_param"], torch.zeros(3))


def test_unexpected_keys_raise_when_strict_and_are_ignored_when_not(pristine, tmp_path):
    net, opt, sd, before = _fresh_target()
    del sd["model"]["b.weight"]
    with pytest.raises(IncompatibleStateDict, match="unexpected keys.*model.b.weight"):
        skc.load(sd, str(pristine[0]))
    assert _same(_snapshot(sd), {k: v for k, v in before.items() if k != "model.b.weight"})
    skc.load(sd, str(pristine[0]), strict=False)
    assert torch.equal(sd["model"]["a.bias"], pristine[1]["model.a.bias"])


@pytest.mark.parametrize("strict", [True, False])
def test_mis_shaped_or_mis_typed_keys_raise_even_when_not_strict(pristine, strict):
    net, opt, sd, _ = _fresh_target()
    sd["model"]["a.weight"] = torch.zeros(21, 34)
    before = _snapshot(sd)
    with pytest.raises(IncompatibleStateDict, match="model.a.weight.*\\[21, 33\\]"):
        skc.load(sd, str(pristine[0]), strict=strict)
    assert _same(_snapshot(sd), before)  # validation precedes every write
    net, opt, sd, before = _fresh_target()
    sd["model"]["a.bias"] = torch.zeros(21, dtype=torch.float64)
    with pytest.raises(IncompatibleStateDict, match="model.a.bias.*float64"):
        skc.load(sd, str(pristine[0]), strict=strict)


def test_values_that_json_cannot_hold_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigurationError, match="extra.when"):
        skc.save({"model": {"w": torch.ones(2)}, "extra": {"when": object()}}, str(tmp_path / "x"))
    assert not (tmp_path / "x" / "manifest.json").exists()


# --------------------------------------------------------------------------
# damaged data files


def test_truncated_data_file_raises_naming_the_file_and_writes_nothing(pristine, tmp_path):
    ckpt = _copy(pristine[0], tmp_path)
    victim = _data_files(ckpt)[-1]
    victim.write_bytes(victim.read_bytes()[:-100])
    net, opt, sd, before = _fresh_target()
    with pytest.raises(CorruptCheckpoint, match=victim.name):
        skc.load(sd, str(ckpt))
    assert _same(_snapshot(sd), before)


def test_missing_data_file_raises_and_writes_nothing(pristine, tmp_path):
    ckpt = _copy(pristine[0], tmp_path)
    victim = _data_files(ckpt)[0]
    victim.unlink()
    net, opt, sd, before = _fresh_target()
    with pytest.raises(CorruptCheckpoint, match=f"{victim.name} is missing"):
        skc.load(sd, str(ckpt))
    assert _same(_snapshot(sd), before)


def _flip(ckpt: Path, fqn: str, chunk: int, at: int) -> dict:
    rec = _manifest(ckpt)["tensors"][fqn]["chunks"][chunk]
    data = bytearray((ckpt / rec["file"]).read_bytes())
    data[rec["start"] + at] ^= 0x10
    (ckpt / rec["file"]).write_bytes(bytes(data))
    return rec


def _block_at(ckpt: Path, fqn: str, chunk: int, at: int) -> int:
    """The index the manifest gives the checksum block holding stored byte ``at`` of a chunk
    (counted strip after strip for a chunk stored as column strips)."""
    rec = parse_manifest((ckpt / "manifest.json").read_bytes(), "manifest").tensors[fqn].chunks[chunk]
    first = 0
    for piece in rec.pieces():
        if piece.start <= rec.start + at < piece.start + piece.nbytes:
            return first + (rec.start + at - piece.start) // piece.block
        first += len(piece.crc32c)
    raise AssertionError(f"byte {at} is not in the chunk")


def test_flipped_bytes_fail_the_checksum_and_leave_every_target_untouched(pristine, tmp_path):
    ckpt = _copy(pristine[0], tmp_path)
    rec = _flip(ckpt, "model.a.weight", 1, 300)
    block = _block_at(ckpt, "model.a.weight", 1, 300)
    net, opt, sd, before = _fresh_target()
    with pytest.raises(ChecksumMismatch, match="model.a.weight.*" + Path(rec["file"]).name + f".*block {block} "):
        skc.load(sd, str(ckpt), verify_first=True)
    assert _same(_snapshot(sd), before)
    with pytest.raises(ChecksumMismatch, match=f"checksum block {block} "):  # the one-pass default detects it too
        skc.load(sd, str(ckpt))


def test_a_damaged_newest_step_leaves_the_model_untouched_and_the_manager_loads_the_previous(tmp_path, caplog):
    net, opt = _trained(1)
    manager = skc.CheckpointManager(str(tmp_path / "run"))
    manager.save(1, net, opt)
    older = _snapshot(_state(net, opt))
    net.a.weight.data.add_(1.0)
    manager.save(2, net, opt, extra={"newest": True})
    _flip(Path(manager.url_of(2)), "optim.state.b.weight.exp_avg", 0, 7)
    target, target_opt, _, before = _fresh_target()
    with pytest.raises(ChecksumMismatch, match="exp_avg"):
        manager.load(2, target, target_opt, verify_first=True)
    assert _same(_snapshot(_state(target, target_opt)), before)
    assert manager.load_latest(target, target_opt) == (1, None)
    assert any(r.levelname == "WARNING" and "step 2 " in r.message and "damaged" in r.message
               for r in caplog.records)
    assert _same(_snapshot(_state(target, target_opt)), older)


@pytest.mark.parametrize("stage_bytes", [64 << 20, 2048, 0], ids=["staged", "partly-staged", "two-pass"])
def test_flipped_bytes_on_remote_storage_leave_targets_untouched(pristine, stage_bytes):
    import fsspec

    url = f"memory://flipped-{stage_bytes}"
    fs = fsspec.filesystem("memory")
    for path in sorted(pristine[0].rglob("*")):
        if path.is_file():
            fs.pipe(f"{url}/{path.relative_to(pristine[0]).as_posix()}", path.read_bytes())
    skc.load(_fresh_target()[2], url)  # intact: loads
    rec = _manifest(pristine[0])["tensors"]["model.b.weight"]["chunks"][-1]
    data = bytearray(fs.cat_file(f"{url}/{rec['file']}"))
    data[rec["start"] + rec["nbytes"] - 1] ^= 0x01
    fs.pipe(f"{url}/{rec['file']}", bytes(data))
    net, opt, sd, before = _fresh_target()
    try:
        with pytest.raises(ChecksumMismatch, match="model.b.weight"):
            skc.load(sd, url, staging_bytes=stage_bytes, verify_first=True)
        assert _same(_snapshot(sd), before)
    finally:
        fs.rm(url, recursive=True)


def _sharded_rows(fill: float | None):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) if fill is None else torch.full((64, 16), fill)
    return {"w": distribute_tensor(full, mesh, [Shard(0)])}


def _save_rows(url: str) -> None:
    skc.save(_sharded_rows(None), url, chunk_bytes=1024)


def _load_rows(url: str) -> tuple[str, bool]:
    sd = _sharded_rows(-1.0)
    try:
        skc.load(sd, url, verify_first=True)
    except ShardkitError as exc:
        return type(exc).__name__, bool((sd["w"].to_local() == -1.0).all())
    return "loaded", bool((sd["w"].to_local() == -1.0).all())


def test_a_checksum_error_on_one_rank_leaves_every_rank_untouched(tmp_path):
    from tests.support.dist import run_on_ranks

    url = str(tmp_path / "rows")
    run_on_ranks(2, _save_rows, url)
    chunks = _manifest(Path(url))["tensors"]["w"]["chunks"]
    last = max(range(len(chunks)), key=lambda i: chunks[i]["offsets"][0])  # rows only rank 1 loads
    _flip(Path(url), "w", last, 5)
    assert run_on_ranks(2, _load_rows, url) == [("ChecksumMismatch", True)] * 2


# --------------------------------------------------------------------------
# hostile or damaged manifests


def _load_fresh(ckpt: Path) -> None:
    net, opt, sd, before = _fresh_target()
    try:
        skc.load(sd, str(ckpt))
    finally:
        assert _same(_snapshot(sd), before)


def test_a_manifest_of_a_future_version_is_refused(pristine, tmp_path):
    ckpt = _copy(pristine[0], tmp_path)
    doc = _manifest(ckpt)
    doc["version"] = VERSION + 1
    _write_manifest(ckpt, doc)
    with pytest.raises(UnsupportedVersion, match=f"version {VERSION + 1}.*Upgrade shardkit"):
        _load_fresh(ckpt)


@pytest.mark.parametrize("name", ["../outside.safetensors", "data/../../outside.safetensors", "/etc/passwd",
                                  "s3://other-bucket/x.safetensors", "file:///etc/passwd", "data\\..\\x"])
def test_file_names_pointing_outside_the_checkpoint_are_refused(pristine, tmp_path, name):
    ckpt = _copy(pristine[0], tmp_path)
    (tmp_path / "outside.safetensors").write_bytes(b"x" * 10_000)
    doc = _manifest(ckpt)
    old = doc["tensors"]["model.a.weight"]["chunks"][0]["file"]
    doc["files"][name] = doc["files"].pop(old)
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            if c["file"] == old:
                c["file"] = name
    _write_manifest(ckpt, doc)
    with pytest.raises(UnsafeCheckpoint, match="outside the checkpoint"):
        _load_fresh(ckpt)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["tensors"]["model.a.weight"].__setitem__("shape", [2**60, 2**60]), "absurd shape|integer"),
    (lambda d: d["tensors"]["model.a.weight"]["chunks"][0].__setitem__("offsets", [10**9, 0]), "exceed"),
    (lambda d: d["tensors"]["model.a.weight"]["chunks"][0].__setitem__("offsets", [-1, 0]), "integer in"),
    (lambda d: d["tensors"]["model.a.weight"]["chunks"][0].__setitem__("start", 10**12), "beyond the end"),
    (lambda d: d["tensors"]["model.a.weight"]["chunks"][0].__setitem__("nbytes", 8), "stored bytes"),
    (lambda d: d["tensors"]["model.a.weight"]["chunks"].pop(), "holes or overlaps|elements"),
    (lambda d: d["tensors"]["model.a.weight"].__setitem__("dtype", "F128"), "unknown dtype"),
    (lambda d: d["tensors"]["model.a.weight"]["chunks"][0].__setitem__("codec", "lz4"), "unknown codec"),
    (lambda d: d["tensors"]["model.a.weight"]["chunks"][0].__setitem__("crc32c", "!!"), "block checksums"),
    (lambda d: d.__setitem__("tensors", []), "must be a JSON object"),
    (lambda d: d.__setitem__("format", "dcp"), "not a shardkit manifest"),
], ids=["huge-shape", "offset-outside", "negative-offset", "start-beyond-file", "short-nbytes", "hole",
        "dtype", "codec", "checksums", "tensors-type", "format"])
def test_absurd_or_inconsistent_manifests_raise_invalid_manifest(pristine, tmp_path, edit, match):
    ckpt = _copy(pristine[0], tmp_path)
    doc = _manifest(ckpt)
    edit(doc)
    _write_manifest(ckpt, doc)
    with pytest.raises(InvalidManifest, match=match):
        _load_fresh(ckpt)


def test_manifest_that_is_not_json_or_missing(pristine, tmp_path):
    ckpt = _copy(pristine[0], tmp_path)
    (ckpt / "manifest.json").write_bytes(b'{"format": "shardkit", "vers')
    with pytest.raises(InvalidManifest, match="not valid JSON"):
        _load_fresh(ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointNotFound, match="not a committed"):
        _load_fresh(ckpt)


# --------------------------------------------------------------------------
# fuzz: seeded mutations of the manifest and the data files


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


_ODD_VALUES = [None, True, -1, 0, 2**63, 2**40, 1.5, float("1e308"), "", "../../x", "/abs", "F32", "zstd",
               [], [1, 2], {}, {"a": 1}, "A" * 50]


def _mutate_manifest(doc: dict, rng: random.Random) -> dict:
    doc = copy.deepcopy(doc)
    paths = [p for p in _paths(doc) if p]
    path = rng.choice(paths)
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    action = rng.random()
    if action < 0.2 and isinstance(parent, dict):
        del parent[key]
    elif action < 0.4 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] = parent[key] + rng.choice([-1, 1, 7, -(2**31), 2**31])
    else:
        parent[key] = copy.deepcopy(rng.choice(_ODD_VALUES))
    return doc


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    action = rng.random()
    if action < 0.5 and data:
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if action < 0.8:
        return data[:rng.randrange(len(data) + 1)]
    return data + bytes(rng.randrange(1, 64))


def test_fuzzed_manifests_and_data_files_raise_shardkit_errors_or_load_correctly(pristine, tmp_path):
    rng = random.Random(1234)
    original = _manifest(pristine[0])
    raw_manifest = (pristine[0] / "manifest.json").read_bytes()
    outcomes = {"error": 0, "loaded": 0}
    for i in range(160):
        ckpt = tmp_path / f"f{i}"
        shutil.copytree(pristine[0], ckpt)
        kind = rng.random()
        if kind < 0.45:
            _write_manifest(ckpt, _mutate_manifest(original, rng))
        elif kind < 0.55:
            (ckpt / "manifest.json").write_bytes(_mutate_bytes(raw_manifest, rng))
        else:
            victim = rng.choice(_data_files(ckpt))
            victim.write_bytes(_mutate_bytes(victim.read_bytes(), rng))
        net, opt, sd, before = _fresh_target()
        one_pass = i % 4 != 3  # the default: errors are still ShardkitErrors, targets may be partly loaded
        try:
            skc.load(sd, str(ckpt), verify_first=not one_pass)
        except ShardkitError:
            outcomes["error"] += 1
            if not one_pass:  # verify_first: every check, checksums included, precedes the first write
                assert _same(_snapshot(sd), before), f"mutation {i} left a half-loaded state"
        else:
            outcomes["loaded"] += 1
            loaded = _snapshot(sd)
            assert _same(loaded, pristine[1]), f"mutation {i} loaded without error but with wrong data"
        shutil.rmtree(ckpt)
    assert outcomes["error"] > 100 and outcomes["loaded"] > 0, outcomes


# --------------------------------------------------------------------------
# no pickle anywhere


def test_every_fixture_loads_with_pickle_and_torch_load_made_to_raise(pristine, tmp_path, monkeypatch):
    net, opt = _trained(3)
    fixtures = {"plain": dict(), "zstd": dict(compression="zstd:5"), "tiny-chunks": dict(chunk_bytes=1024)}
    sd = _state(net, opt)
    sd["extra"] = {"loss": float("nan"), "history": [1.0, float("inf")], "name": "run", "nested": [[1], {"k": None}]}
    for name, opts in fixtures.items():
        skc.save(sd, str(tmp_path / name), **opts)
    skc.CheckpointManager(str(tmp_path / "managed")).save(3, net, opt, extra={"epoch": 2})

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used while loading a checkpoint")

    class RefusingUnpickler:
        def __init__(self, *args, **kwargs):
            refuse()

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", RefusingUnpickler)
    monkeypatch.setattr(torch, "load", refuse)
    for name in [*fixtures, "pristine"]:
        target_net, target_opt = _trained(9)
        target = _state(target_net, target_opt)
        target["extra"] = {"loss": 0.0, "history": [0.0, 0.0], "name": "", "nested": [[0], {"k": 1}]}
        url = str(pristine[0]) if name == "pristine" else str(tmp_path / name)
        if name == "pristine":
            del target["extra"]
        skc.load(target, url)
        if name != "pristine":
            assert torch.equal(target["model"]["a.weight"], sd["model"]["a.weight"])
            loss = target["extra"]["loss"]
            assert loss != loss and target["extra"]["history"] == [1.0, float("inf")]
            assert target["extra"]["nested"] == [[1], {"k": None}]
    assert skc.CheckpointManager(str(tmp_path / "managed")).load_latest(*_trained(4)) == (3, {"epoch": 2})


def test_a_negative_staging_budget_is_refused_naming_it_and_nothing_is_written(pristine):
    _, _, sd, before = _fresh_target()
    with pytest.raises(ConfigurationError, match="staging_bytes must be >= 0"):
        skc.load(sd, str(pristine[0]), staging_bytes=-1)
    assert _same(_snapshot(sd), before)
