"""Steps that store only what changed: ``CheckpointManager(dedup=True)`` references unchanged chunks of the
newest committed step instead of writing them again, and every tool follows those references."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import shardkit.checkpoint as skc
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CorruptCheckpoint, InvalidManifest, UnsafeCheckpoint

CHUNK = 64 << 10


class FineTune(nn.Module):
    """A frozen base (about 1 MB, many chunks) and a small trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(512, 512)
        self.head = nn.Linear(512, 16)
        self.base.requires_grad_(False)
        with torch.no_grad():
            self.base.weight.copy_(torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512) / 1000)
            self.base.bias.fill_(0.5)
            self.head.weight.zero_()
            self.head.bias.zero_()


def at_step(model: FineTune, step: int) -> FineTune:
    with torch.no_grad():
        model.head.weight.fill_(step)
        model.head.bias.fill_(-step)
    return model


def head_bytes(model: FineTune) -> int:
    return sum(p.numel() * p.element_size() for p in model.head.parameters())


def data_bytes(step_dir: Path) -> int:
    return sum(f.stat().st_size for f in (step_dir / "data").glob("*.safetensors")) if (step_dir / "data").exists() \
        else 0


def manifest_of(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())


def step_path(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def loaded(url: str) -> FineTune:
    model = FineTune()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    sd = {"model": model.state_dict()}
    skc.load(sd, url)
    return model


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def three_steps(root: Path, **options) -> skc.CheckpointManager:
    manager = skc.CheckpointManager(str(root), **{"dedup": True, **options}, chunk_bytes=CHUNK)
    model = FineTune()
    for step in (1, 2, 3):
        manager.save(step, at_step(model, step), rng=False)
    manager.wait()
    return manager


def test_a_step_that_changed_only_the_head_writes_only_the_head(tmp_path):
    three_steps(tmp_path)
    first, third = step_path(tmp_path, 1), step_path(tmp_path, 3)
    assert data_bytes(first) > 1_000_000
    written = data_bytes(third)
    assert written <= 1.1 * head_bytes(FineTune()) + 4096, written  # + the safetensors header
    doc = manifest_of(third)
    assert doc["version"] == 4 and doc["references"] == [first.name]
    chunks = [c for t in doc["tensors"].values() for c in t["chunks"]]
    assert all(c["digest"].startswith("xxh3-128:") and len(c["digest"]) == 9 + 32 for c in chunks)
    assert {c["file"].split("/")[1] for c in chunks if c["file"].startswith("../")} == {first.name}
    assert same(loaded(str(third)), at_step(FineTune(), 3))
    assert skc.verify(str(third)).ok


def test_references_never_chain_they_name_the_step_that_wrote_the_bytes(tmp_path):
    three_steps(tmp_path)
    second = manifest_of(step_path(tmp_path, 2))
    third = manifest_of(step_path(tmp_path, 3))
    assert second["references"] == third["references"] == [step_path(tmp_path, 1).name]


def test_retention_keeps_a_step_whose_data_a_kept_step_references(tmp_path):
    manager = three_steps(tmp_path, keep_last=1)
    assert manager.steps() == [1, 3]  # step 2 went; step 1 holds the base step 3 reads
    assert same(loaded(manager.url_of(3)), at_step(FineTune(), 3))
    manager.save(4, at_step(FineTune(), 4), rng=False)
    assert manager.steps() == [1, 4]
    assert skc.verify(manager.url_of(4)).ok


def test_a_changed_base_is_written_again_and_the_old_step_is_released(tmp_path):
    manager = three_steps(tmp_path, keep_last=1)
    model = at_step(FineTune(), 4)
    with torch.no_grad():
        model.base.weight.add_(1.0)
        model.base.bias.add_(1.0)
    manager.save(4, model, rng=False)
    assert manifest_of(step_path(tmp_path, 4)).get("references") is None
    assert manager.steps() == [4]
    assert same(loaded(manager.url_of(4)), model)


def test_reshard_and_convert_follow_references_into_self_contained_copies(tmp_path):
    three_steps(tmp_path)
    src = str(step_path(tmp_path, 3))
    resharded, converted = tmp_path / "out" / "ws2", tmp_path / "out" / "hf"
    skc.reshard(src, str(resharded), world_size=2)
    skc.convert(src, str(converted), to="shardkit")
    for out in (resharded, converted):
        assert "references" not in manifest_of(out)
        assert not any("../" in c["file"] for t in manifest_of(out)["tensors"].values() for c in t["chunks"])
        assert skc.verify(str(out)).ok
        assert same(loaded(str(out)), at_step(FineTune(), 3))
        assert skc.diff(src, str(out)).equal


def test_cloud_migration_reads_each_referenced_file_once(tmp_path, s3_url, monkeypatch):
    three_steps(tmp_path)
    src = step_path(tmp_path, 3)
    referenced = {c["file"] for t in manifest_of(src)["tensors"].values() for c in t["chunks"]
                  if c["file"].startswith("../")}
    read: dict[str, int] = {}
    original = Storage.read_parts

    def counting(self, name, start, parts):
        read[name] = read.get(name, 0) + sum(p.numel() for p in parts)
        return original(self, name, start, parts)

    monkeypatch.setattr(Storage, "read_parts", counting)
    bucket, options = s3_url
    skc.reshard(str(src), f"{bucket}/run/step-3", world_size=2, dst_storage_options=options)
    sizes = {name: Storage(str(src)).size(name) for name in referenced}
    assert referenced and all(0 < read.get(name, 0) <= sizes[name] for name in referenced), (read, sizes)
    monkeypatch.undo()
    assert skc.verify(f"{bucket}/run/step-3", storage_options=options).ok
    model = FineTune()
    sd = {"model": model.state_dict()}
    skc.load(sd, f"{bucket}/run/step-3", storage_options=options)
    assert same(model, at_step(FineTune(), 3))


def test_a_hand_deleted_referenced_step_is_named_by_verify(tmp_path):
    three_steps(tmp_path)
    shutil.rmtree(step_path(tmp_path, 1))
    report = skc.verify(str(step_path(tmp_path, 3)))
    assert not report.ok
    assert any(step_path(tmp_path, 1).name in p and "deleted or moved by hand" in p for p in report.problems), \
        report.problems
    from tests.support.offline_cli import run_cli

    out = run_cli("verify", str(step_path(tmp_path, 3)))
    assert out.exit_code != 0 and "deleted or moved by hand" in out.stdout + out.stderr


def test_load_fails_before_writing_any_target_when_a_referenced_file_is_missing(tmp_path):
    three_steps(tmp_path)
    shutil.rmtree(step_path(tmp_path, 1) / "data")
    model = FineTune()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    sd = {"model": model.state_dict()}
    with pytest.raises(CorruptCheckpoint, match=f"references that file of {step_path(tmp_path, 1).name}"):
        skc.load(sd, str(step_path(tmp_path, 3)))
    assert all(bool((p == 7.0).all()) for p in model.parameters())


def test_saving_a_referenced_step_again_keeps_the_files_its_sibling_reads(tmp_path):
    manager = three_steps(tmp_path)
    manager.durable.dedup = None
    manager.save(1, at_step(FineTune(), 1), rng=False)  # a full rewrite of step 1 under new file names
    assert skc.verify(manager.url_of(3)).ok
    assert same(loaded(manager.url_of(3)), at_step(FineTune(), 3))
    assert skc.verify(manager.url_of(1)).ok


def test_a_referenced_file_deleted_by_hand_is_written_again_by_the_next_save(tmp_path):
    manager = three_steps(tmp_path)
    for f in (step_path(tmp_path, 1) / "data").glob("*.safetensors"):
        f.unlink()
    manager.save(4, at_step(FineTune(), 4), rng=False)
    assert "references" not in manifest_of(step_path(tmp_path, 4))
    assert same(loaded(manager.url_of(4)), at_step(FineTune(), 4))


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_async_dedup_saves_reference_too(tmp_path, writer):
    manager = three_steps(tmp_path, async_save=True, writer=writer)
    assert manifest_of(step_path(tmp_path, 3))["references"] == [step_path(tmp_path, 1).name]
    assert same(loaded(manager.url_of(3)), at_step(FineTune(), 3))


def _manifest_with_reference(tmp_path: Path, name: str, version: int = 4, listed: bool = True) -> Path:
    three_steps(tmp_path)
    third = step_path(tmp_path, 3)
    doc = manifest_of(third)
    old = next(c["file"] for t in doc["tensors"].values() for c in t["chunks"] if c["file"].startswith("../"))
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            c["file"] = name if c["file"] == old else c["file"]
    doc["files"][name] = doc["files"].pop(old)
    doc["version"] = version
    if not listed:
        doc.pop("references")
    (third / "manifest.json").write_text(json.dumps(doc))
    return third


@pytest.mark.parametrize("name, error", [
    ("../../elsewhere/data/x.safetensors", UnsafeCheckpoint),
    ("../step-0000000001/manifest.json", InvalidManifest),
    ("../step-0000000001/../../x.safetensors", UnsafeCheckpoint),
    ("..//data/x.safetensors", UnsafeCheckpoint),
])
def test_references_that_leave_the_root_or_name_no_data_file_are_refused(tmp_path, name, error):
    third = _manifest_with_reference(tmp_path, name)
    with pytest.raises(error):
        skc.open_reader(str(third)).tensors()


def test_a_reference_in_a_manifest_older_than_version_4_is_refused(tmp_path):
    third = _manifest_with_reference(tmp_path, "../step-0000000001/data/0000000000-0-0.safetensors", version=2)
    with pytest.raises(UnsafeCheckpoint, match="format version 2"):
        skc.open_reader(str(third))


def test_a_reference_to_a_directory_the_manifest_does_not_list_is_refused(tmp_path):
    third = _manifest_with_reference(tmp_path, "../step-0000000001/data/0000000000-0-0.safetensors", listed=False)
    with pytest.raises(InvalidManifest, match="does not list"):
        skc.open_reader(str(third))


def test_a_malformed_digest_is_refused(tmp_path):
    three_steps(tmp_path)
    third = step_path(tmp_path, 3)
    doc = manifest_of(third)
    next(iter(doc["tensors"].values()))["chunks"][0]["digest"] = "md5:XYZ"
    (third / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(InvalidManifest, match="digest"):
        skc.open_reader(str(third))


def test_sha256_digests_for_those_who_need_a_cryptographic_hash(tmp_path):
    three_steps(tmp_path, dedup="sha256")
    doc = manifest_of(step_path(tmp_path, 3))
    assert doc["references"] == [step_path(tmp_path, 1).name]
    assert all(c["digest"].startswith("sha256:") for t in doc["tensors"].values() for c in t["chunks"])
    assert same(loaded(str(step_path(tmp_path, 3))), at_step(FineTune(), 3))


def test_a_step_hashed_with_another_algorithm_is_not_reused(tmp_path):
    three_steps(tmp_path, dedup="sha256")
    manager = skc.CheckpointManager(str(tmp_path), dedup=True, chunk_bytes=CHUNK)
    manager.save(4, at_step(FineTune(), 4), rng=False)
    assert "references" not in manifest_of(step_path(tmp_path, 4))
    manager.save(5, at_step(FineTune(), 5), rng=False)
    assert manifest_of(step_path(tmp_path, 5))["references"] == [step_path(tmp_path, 4).name]


def test_an_unknown_digest_algorithm_is_refused_up_front(tmp_path):
    from shardkit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="md5"):
        skc.CheckpointManager(str(tmp_path), dedup="md5")
    with pytest.raises(ConfigurationError, match="md5"):
        skc.save({"x": torch.zeros(3)}, str(tmp_path / "x"), digests="md5")
    assert not (tmp_path / "x").exists()


# -- a kill at any moment of a dedup save ------------------------------------------------------------

KILLS = 6


def _save_forever(root: str, start: int, report: str) -> None:
    torch.set_num_threads(1)
    manager = skc.CheckpointManager(root, keep_last=2, dedup=True, chunk_bytes=CHUNK)
    model = FineTune()
    step = start
    while True:
        manager.save(step, at_step(model, step), extra={"step": step}, rng=False)
        with open(report, "a") as f:
            f.write(f"{step}\n")
        step += 1


def test_a_kill_during_dedup_saves_never_loses_the_newest_committed_step(tmp_path):
    root, report = tmp_path / "run", str(tmp_path / "report")
    skc.CheckpointManager(str(root), dedup=True, chunk_bytes=CHUNK).save(0, at_step(FineTune(), 0), rng=False,
                                                                         extra={"step": 0})
    checker = skc.CheckpointManager(str(root))
    rng = random.Random(13)
    ctx = multiprocessing.get_context("fork")
    newest = []
    for _ in range(KILLS):
        proc = ctx.Process(target=_save_forever, args=(str(root), checker.steps()[-1] + 1, report))
        proc.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        committed = checker.steps()
        with open(report) as f:
            reported = int(f.read().split()[-1])
        model = FineTune()
        step, extra = checker.load_latest(model)
        assert step == committed[-1] >= reported and extra == {"step": step}
        assert same(model, at_step(FineTune(), step))
        for s in committed:  # every committed step is whole, the ones referenced by newer steps included
            assert skc.verify(checker.url_of(s)).ok, s
        newest.append(step)
    assert newest == sorted(newest) and newest[-1] > newest[0]
    assert any("references" in manifest_of(step_path(root, s)) for s in checker.steps())


# -- many ranks, and version 4 with index files ------------------------------------------------------

def _values(step: int) -> dict[str, torch.Tensor]:
    from tests.checkpoint.formats.native.test_indexed import truth_values

    values = truth_values()
    values["model.w"] = values["model.w"] + step  # the trainable part; the rest is frozen
    return values


def _save_two_steps(root: str, mesh_shape: tuple[int, ...], kind: str, indexed: bool) -> None:
    from contextlib import nullcontext

    from tests.checkpoint.formats.native.test_indexed import always_indexed, shard_on_mesh

    with always_indexed() if indexed else nullcontext():
        for step in (1, 2):
            skc.save(shard_on_mesh(_values(step), mesh_shape, kind), f"{root}/step-{step}", chunk_bytes=1024,
                     block_bytes=512, digests=True, reuse_from=f"{root}/step-1" if step == 2 else None)


def _load_on_ranks(url: str) -> bool:
    from tests.checkpoint.formats.native.test_indexed import shard_on_mesh

    expected = _values(2)
    state = {k: torch.zeros_like(v) for k, v in shard_on_mesh(expected, (3,), "S0").items()}
    skc.load(state, url)
    return all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, expected[k]) for k, v in state.items())


@pytest.mark.parametrize("layout, indexed", [(((4,), "S0"), False), (((2, 2), "R,S0"), True)])
def test_every_rank_references_its_own_unchanged_chunks(tmp_path, layout, indexed):
    from tests.support.dist import run_on_ranks

    root = tmp_path / "run"
    run_on_ranks(4, _save_two_steps, str(root), *layout, indexed)
    second = root / "step-2"
    doc = manifest_of(second)
    assert doc["version"] == 4 and doc["references"] == ["step-1"] and ("indexes" in doc) == indexed
    assert data_bytes(second) < 37 * 26 * 4 + 4 * 4096  # model.w only, in at most one file per rank
    plain = {k: torch.zeros_like(v) for k, v in _values(2).items()}
    skc.load(plain, str(second))
    assert all(torch.equal(plain[k], v) for k, v in _values(2).items())
    assert run_on_ranks(3, _load_on_ranks, str(second)) == [True] * 3
    assert skc.verify(str(second)).ok


def test_inspect_names_the_steps_a_checkpoint_references(tmp_path):
    from tests.support.offline_cli import run_cli

    three_steps(tmp_path)
    third, first = str(step_path(tmp_path, 3)), step_path(tmp_path, 1).name
    info = skc.inspect(third)
    assert info["version"] == 4 and list(info["references"]) == [first]
    assert info["references"][first] == info["totals"]["bytes"] - head_bytes(FineTune())
    assert "references" not in skc.inspect(str(step_path(tmp_path, 1)))
    out = run_cli("inspect", third)
    assert out.exit_code == 0 and f"stored by ../{first}" in out.stdout
    out = run_cli("verify", third)
    assert out.exit_code == 0, out.stderr


def test_inspect_of_a_step_whose_referenced_step_is_gone_names_it_and_exits_1(tmp_path):
    from tests.support.offline_cli import run_cli

    three_steps(tmp_path)
    third, first = step_path(tmp_path, 3), step_path(tmp_path, 1)
    referenced = sorted({c["file"] for t in manifest_of(third)["tensors"].values() for c in t["chunks"]
                         if c["file"].startswith("../")})
    shutil.rmtree(first)
    assert skc.inspect(str(third))["missing_references"] == {first.name: [f.split("/", 2)[2] for f in referenced]}
    out = run_cli("inspect", str(third))
    assert out.exit_code == 1
    assert "total: " in out.stdout  # the description still stands: it is the manifest's
    missing, error = out.stderr.strip().splitlines()[-2:]
    files = "data file" if len(referenced) == 1 else "data files"
    assert missing == (f"missing: {len(referenced)} {files} of ../{first.name} that this checkpoint references, "
                       f"e.g. {referenced[0]}")
    assert error == (f"error: {third} cannot be loaded: data it references in ../{first.name} is gone (deleted or "
                     "moved by hand); restore it, or use another checkpoint")
    assert run_cli("inspect", str(third), "--json").exit_code == 1
    assert run_cli("inspect", str(step_path(tmp_path, 2))).exit_code == 1  # step 2 reads step 1's base too


def test_saving_a_step_again_with_dedup_keeps_using_its_own_files(tmp_path):
    manager = three_steps(tmp_path)
    manager.save(1, at_step(FineTune(), 1), rng=False)  # reuses from step 3, which reads step 1's base
    assert "references" not in manifest_of(step_path(tmp_path, 1))
    shutil.rmtree(step_path(tmp_path, 2))
    shutil.rmtree(step_path(tmp_path, 3))
    assert skc.verify(manager.url_of(1)).ok
    assert same(loaded(manager.url_of(1)), at_step(FineTune(), 1))


def test_load_latest_falls_back_past_a_step_whose_referenced_data_is_gone(tmp_path, caplog):
    manager = three_steps(tmp_path)
    model = at_step(FineTune(), 4)
    with torch.no_grad():
        model.base.weight.add_(1.0)
        model.base.bias.add_(1.0)
    manager.save(4, model, rng=False)  # a new base, written in full
    manager.save(5, at_step(model, 5), rng=False)  # reads step 4's base
    shutil.rmtree(step_path(tmp_path, 4) / "data")
    fresh = FineTune()
    step, _ = manager.load_latest(fresh)
    assert step == 3 and same(fresh, at_step(FineTune(), 3))
    assert step_path(tmp_path, 4).name in caplog.text


def test_retention_keeps_referenced_data_even_when_its_manifest_was_deleted_by_hand(tmp_path):
    manager = three_steps(tmp_path, keep_last=1)
    (step_path(tmp_path, 1) / "manifest.json").unlink()  # step 1 is no checkpoint now, but step 3 reads its data
    manager.save(4, at_step(FineTune(), 4), rng=False)  # retention would sweep an interrupted save
    assert (step_path(tmp_path, 1) / "data").is_dir()
    assert skc.verify(manager.url_of(4)).ok
    assert same(loaded(manager.url_of(4)), at_step(FineTune(), 4))


def test_an_offline_overwrite_of_a_referenced_step_keeps_the_data_its_sibling_reads(tmp_path):
    three_steps(tmp_path)
    other = tmp_path / "other"
    skc.save({"model": at_step(FineTune(), 7).state_dict()}, str(other))
    skc.convert(str(other), str(step_path(tmp_path, 1)), overwrite=True)  # step 1 is now another checkpoint
    assert same(loaded(str(step_path(tmp_path, 1))), at_step(FineTune(), 7))
    assert skc.verify(str(step_path(tmp_path, 3))).ok
    skc.reshard(str(step_path(tmp_path, 3)), str(step_path(tmp_path, 2)), world_size=2, overwrite=True)
    for s in (2, 3):
        assert same(loaded(str(step_path(tmp_path, s))), at_step(FineTune(), 3))


def test_retention_keeps_a_step_that_a_checkpoint_beside_the_steps_references(tmp_path):
    manager = skc.CheckpointManager(str(tmp_path), dedup=True, keep_last=1, chunk_bytes=CHUNK)
    model = FineTune()
    manager.save(1, at_step(model, 1), rng=False)
    skc.save({"model": at_step(model, 9).state_dict()}, str(tmp_path / "best"), chunk_bytes=CHUNK, digests=True,
             reuse_from=manager.url_of(1))
    with torch.no_grad():  # the base changes: later steps no longer read step 1, but "best" does
        model.base.weight.add_(1)
        model.base.bias.add_(1)
    manager.save(2, at_step(model, 2), rng=False)
    manager.save(3, at_step(model, 3), rng=False)
    assert manager.steps() == [1, 2, 3]  # 1 for "best", 2 for step 3 (the new base)
    assert same(loaded(str(tmp_path / "best")), at_step(FineTune(), 9))
    shutil.rmtree(tmp_path / "best")
    manager.save(4, at_step(model, 4), rng=False)
    assert manager.steps() == [2, 4]


def test_another_tools_manifest_json_beside_a_checkpoint_does_not_stop_its_cleanup(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "manifest.json").write_text('{"name": "my experiment notes"}')
    for fill in (1.0, 2.0):
        skc.save({"x": torch.full((1000,), fill)}, str(tmp_path / "ck"))
    assert len(list((tmp_path / "ck" / "data").iterdir())) == 1
    assert (tmp_path / "notes" / "manifest.json").exists()


@pytest.mark.parametrize("where", ["s3", "memory"])
def test_dedup_steps_on_object_storage_and_in_memory(tmp_path, where, request):
    import uuid

    if where == "s3":
        root, options = request.getfixturevalue("s3_url")
        root = f"{root}/run"
    else:
        root, options = f"memory://dedup-{uuid.uuid4().hex[:8]}/run", None
    manager = skc.CheckpointManager(root, dedup=True, keep_last=1, chunk_bytes=CHUNK, storage_options=options)
    model = FineTune()
    for step in (1, 2, 3):
        manager.save(step, at_step(model, step), rng=False)
    assert manager.steps() == [1, 3]
    third = manager.url_of(3)
    assert skc.inspect(third, storage_options=options)["references"].keys() == {"step-0000000001"}
    assert skc.verify(third, storage_options=options).ok
    fresh = FineTune()
    assert manager.load_latest(fresh)[0] == 3 and same(fresh, at_step(FineTune(), 3))


def test_odd_names_and_plain_files_beside_checkpoints_never_stop_a_cleanup(tmp_path):
    (tmp_path / "my notes").mkdir()
    (tmp_path / "readme.txt").write_text("not a checkpoint")
    manager = skc.CheckpointManager(str(tmp_path), dedup=True, keep_last=1, chunk_bytes=CHUNK)
    model = FineTune()
    with torch.no_grad():
        for step in (1, 2, 3):
            model.base.weight.add_(1)  # every step a new base: nothing to keep for references
            model.base.bias.fill_(step)
            manager.save(step, at_step(model, step), rng=False)
    manager.save(3, at_step(model, 3), rng=False)  # an overwrite: its older files go
    assert manager.steps() == [3]
    assert len(list((step_path(tmp_path, 3) / "data").iterdir())) == len(manifest_of(step_path(tmp_path, 3))["files"])
    assert (tmp_path / "my notes").is_dir() and (tmp_path / "readme.txt").exists()
