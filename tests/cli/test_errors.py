"""Bad input gives one line ``error: ...``, a non-zero exit, and a DST without a manifest."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.offline_cli import run_cli
from tests.support.offline_helpers import torch_and_native, write_torch_state

COMMANDS = ["reshard", "convert", "inspect", "verify", "diff"]


def _one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert len([ln for ln in lines if ln.startswith("error: ")]) == 1
    for needle in needles:
        assert needle in lines[-1], lines[-1]


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return torch_and_native(tmp_path_factory.mktemp("errors"))


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_shows_an_example(command):
    result = run_cli(command, "--help")
    assert result.exit_code == 0
    assert "Example:" in result.stdout and f"shardkit {command} " in result.stdout


def test_top_level_help_shows_an_example_and_lists_commands():
    result = run_cli("--help")
    assert result.exit_code == 0 and "Example:" in result.stdout
    assert all(c in result.stdout for c in COMMANDS)


def test_missing_src_is_one_line_error(tmp_path):
    result = run_cli("-q", "convert", str(tmp_path / "nope"), str(tmp_path / "dst"), "--to", "hf")
    _one_line_error(result, "nope", "no such file")
    assert not (tmp_path / "dst").exists()


def test_unknown_format_is_one_line_error(tmp_path):
    src = tmp_path / "junk"
    src.mkdir()
    (src / "notes.txt").write_text("hello")
    result = run_cli("-q", "reshard", str(src), str(tmp_path / "dst"), "--world-size", "2")
    _one_line_error(result, "not a checkpoint", "notes.txt")
    (tmp_path / "blob.bin").write_bytes(b"\x00" * 64)
    _one_line_error(run_cli("-q", "inspect", str(tmp_path / "blob.bin")), "unknown file format")


def test_uncommitted_checkpoint_is_named_as_such(tmp_path, native):
    _, out = native
    partial = tmp_path / "partial"
    shutil.copytree(out, partial)
    (partial / "manifest.json").unlink()
    _one_line_error(run_cli("-q", "verify", str(partial)), "uncommitted")


def test_dst_holding_a_checkpoint_is_refused_unless_overwrite(tmp_path, native):
    src, out = native
    dst = tmp_path / "dst"
    shutil.copytree(out, dst)
    before = (dst / "manifest.json").read_bytes()
    _one_line_error(run_cli("-q", "reshard", str(src), str(dst), "--world-size", "3"), "--overwrite")
    assert (dst / "manifest.json").read_bytes() == before
    result = run_cli("-q", "reshard", str(src), str(dst), "--world-size", "3", "--overwrite")
    assert result.exit_code == 0, result.stderr
    assert json.loads((dst / "manifest.json").read_text())["writer"]["world_size"] == 3
    assert all(f.name.split("-")[0] in (dst / "manifest.json").read_text() for f in (dst / "data").iterdir())
    existing = tmp_path / "existing.pt"
    shutil.copy(src, existing)
    _one_line_error(run_cli("-q", "convert", str(src), str(existing), "--to", "torch"), "--overwrite")


def _damage(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_is_named_by_verify_and_stops_a_reshard(tmp_path, native):
    _, out = native
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    victim = sorted((bad / "data").iterdir())[1]
    _damage(victim, victim.stat().st_size - 10)
    result = run_cli("-q", "verify", str(bad))
    assert result.exit_code == 1 and victim.name in result.stderr and "checksum" in result.stderr
    dst = tmp_path / "dst"
    _one_line_error(run_cli("-q", "reshard", str(bad), str(dst), "--world-size", "3"), victim.name)
    assert not (dst / "manifest.json").exists()


def test_truncated_data_file_is_named(tmp_path, native):
    _, out = native
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    victim = sorted((bad / "data").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:100])
    result = run_cli("-q", "verify", str(bad), "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and not report["ok"] and victim.name in report["problems"][0]
    _one_line_error(run_cli("-q", "convert", str(bad), str(tmp_path / "o.pt"), "--to", "torch"), victim.name)
    assert not (tmp_path / "o.pt").exists()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("workers", ["1", "4"])
def test_a_failed_overwrite_leaves_the_old_checkpoint_whole_and_no_partial_files(tmp_path, native, workers):
    _, out = native
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    victim = sorted((bad / "data").iterdir())[0]
    _damage(victim, victim.stat().st_size - 3)
    dst = tmp_path / "dst"
    shutil.copytree(out, dst)
    before = _files(dst)
    _one_line_error(run_cli("-q", "reshard", str(bad), str(dst), "--world-size", "2", "--overwrite",
                            "--workers", workers))
    after = _files(dst)
    assert {n: after[n] for n in before} == before  # not one byte of the old checkpoint changed
    leftovers = [n for n in after if n not in before]
    assert all(n.startswith(".shardkit-resume/") or after[n] for n in leftovers), leftovers  # no empty files
    assert all(f"{n}.json".replace("data/", ".shardkit-resume/") in after for n in leftovers if n.startswith("data/"))
    assert run_cli("-q", "verify", str(dst)).exit_code == 0


def test_a_failed_conversion_removes_the_files_it_wrote_and_nothing_else(tmp_path, native):
    _, out = native
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    for name, tensor in manifest["tensors"].items():
        for chunk in tensor["chunks"]:
            if name.startswith("model.") and chunk["nbytes"]:  # fails mid-stream, once output files exist
                _damage(bad / chunk["file"], chunk["start"] + chunk["nbytes"] // 2)
    for to in ("hf", "dcp"):
        dst = tmp_path / f"dst-{to}"
        dst.mkdir()
        (dst / "README.md").write_text("mine")
        _one_line_error(run_cli("-q", "convert", str(bad), str(dst), "--to", to, "--overwrite"), "checksum")
        assert _files(dst) == {"README.md": b"mine"}, to


@pytest.mark.parametrize("command", [["reshard", "--world-size", "2"], ["convert", "--to", "shardkit"],
                                     ["convert", "--to", "hf"], ["convert", "--to", "dcp"]])
def test_a_directory_of_unrelated_files_is_refused_as_dst_unless_overwrite(tmp_path, native, command):
    src, _ = native
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    args = [command[0], str(src), str(dst), *command[1:]]
    _one_line_error(run_cli("-q", *args), str(dst), "not empty and not a checkpoint", "notes.txt", "--overwrite")
    assert _files(dst) == {"notes.txt": b"mine"}
    result = run_cli("-q", *args, "--overwrite")  # writes beside them, and keeps them
    assert result.exit_code == 0, result.stderr
    assert (dst / "notes.txt").read_text() == "mine" and run_cli("-q", "verify", str(dst)).exit_code == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli("-q", command[0], str(src), str(empty), *command[1:]).exit_code == 0


def test_a_failed_hf_export_removes_the_side_files_it_wrote_so_a_rerun_finds_dst_as_it_was(tmp_path, native,
                                                                                           monkeypatch):
    from shardkit.checkpoint.formats.hf.reader import INDEX_NAME
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.errors import StorageError

    src, _ = native
    config = tmp_path / "config"
    config.mkdir()
    (config / "config.json").write_text('{"tie_word_embeddings": false}')
    (config / "tokenizer.json").write_text("{}")
    dst = tmp_path / "dst"
    args = ["-q", "convert", str(src), str(dst), "--to", "hf", "--config", str(config), "--max-shard-size", "1KB"]
    put_atomic = Storage.put_atomic

    def full_disk_at_the_index(self, name, data):
        if name == INDEX_NAME:
            raise StorageError(f"committing {self.where(name)}: no space left on device")
        return put_atomic(self, name, data)

    with monkeypatch.context() as patch:
        patch.setattr(Storage, "put_atomic", full_disk_at_the_index)
        _one_line_error(run_cli(*args), "no space left")
    assert _files(dst) == {}
    result = run_cli(*args)
    assert result.exit_code == 0, result.stderr
    assert {"config.json", "tokenizer.json", INDEX_NAME} <= set(_files(dst))


def test_damaged_manifest_hf_header_and_torch_file_are_one_line_errors(tmp_path, native):
    src, out = native
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "manifest.json").write_text('{"format": "shardkit", "version": 1, "tensors": ')
    _one_line_error(run_cli("-q", "inspect", str(bad)), "manifest.json")
    hf = tmp_path / "hf"
    assert run_cli("-q", "convert", str(out), str(hf), "--to", "hf").exit_code == 0
    shard = next(hf.glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[0:8] = (10 ** 12).to_bytes(8, "little")
    shard.write_bytes(bytes(raw))
    _one_line_error(run_cli("-q", "convert", str(hf), str(tmp_path / "o"), "--to", "shardkit"), shard.name)
    assert not (tmp_path / "o" / "manifest.json").exists()
    pt = tmp_path / "bad.pt"
    pt.write_bytes(src.read_bytes()[:2000])
    _one_line_error(run_cli("-q", "convert", str(pt), str(tmp_path / "o2"), "--to", "shardkit"), "bad.pt")


def test_bad_options_are_one_line_errors(tmp_path, native):
    _, out = native
    _one_line_error(run_cli("-q", "reshard", str(out), str(tmp_path / "a")), "--world-size")
    _one_line_error(run_cli("-q", "reshard", str(out), str(tmp_path / "b"), "--world-size", "2", "--dtype", "int3"),
                    "--dtype")
    _one_line_error(run_cli("-q", "reshard", str(out), str(tmp_path / "c"), "--world-size", "2",
                            "--compression", "lz4"), "compression")
    _one_line_error(run_cli("-q", "reshard", str(out), str(tmp_path / "d"), "--mesh", "2x2x2"), "--mesh")
    _one_line_error(run_cli("-q", "reshard", str(out), str(tmp_path / "e"), "--mesh", "2xq"), "--mesh")
    _one_line_error(run_cli("-q", "convert", str(out), str(tmp_path / "f"), "--to", "hf", "--max-shard-size", "-5GB"),
                    "--max-shard-size", "positive")
    _one_line_error(run_cli("-q", "reshard", str(out), str(tmp_path / "g"), "--world-size", "2",
                            "--max-memory", "lots"), "--max-memory", "lots")
    assert not any((tmp_path / n).exists() for n in "defg")


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (we run as root); ``None`` when mounting is not possible here."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_full_disk_is_one_line_error_and_leaves_no_manifest(tmp_path, small_disk):
    torch.manual_seed(0)
    flat = {"model.big": torch.randn(1024, 1024)}  # 4 MiB: does not fit on the 2 MiB disk
    src = write_torch_state(tmp_path / "big.pt", flat, [])
    if small_disk is not None:
        dst = small_disk / "out"
        _one_line_error(run_cli("-q", "reshard", str(src), str(dst), "--world-size", "2"),
                        "no space left on device (ENOSPC)")
        assert not (dst / "manifest.json").exists()
        return
    # No mount privilege: the same write path under a file-size limit (EFBIG instead of ENOSPC).
    dst = tmp_path / "out"
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)); "
            "from shardkit.cli.main import main; main(sys.argv[1:])")
    done = subprocess.run([sys.executable, "-c", code, "-q", "reshard", str(src), str(dst), "--world-size", "2"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 1 and done.stderr.strip().startswith("error: ")
    assert not (dst / "manifest.json").exists()


def test_unreadable_src_is_one_line_error(tmp_path, native):
    src, _ = native
    locked = tmp_path / "locked.pt"
    shutil.copy(src, locked)
    os.chmod(locked, 0)
    cmd = [sys.executable, "-m", "shardkit", "-q", "convert", str(locked), str(tmp_path / "out"), "--to", "hf"]
    if os.geteuid() == 0:  # root reads anything: drop the capabilities that bypass file modes
        setpriv = shutil.which("setpriv")
        assert setpriv, "setpriv (util-linux) is needed to test permissions as root"
        caps = "-dac_override,-dac_read_search"
        cmd = [setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=os.getcwd())
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "permission denied" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_dst_that_is_or_lies_inside_src_is_refused_and_src_survives(tmp_path, native):
    src, out = native
    ckpt = tmp_path / "ckpt"
    shutil.copytree(out, ckpt)
    before = {p.name: p.read_bytes() for p in [ckpt / "manifest.json", *sorted((ckpt / "data").iterdir())]}
    _one_line_error(run_cli("-q", "reshard", str(ckpt), str(ckpt), "--world-size", "3", "--overwrite"), "overlaps")
    _one_line_error(run_cli("-q", "reshard", str(ckpt), str(ckpt) + "/", "--world-size", "3", "--overwrite"),
                    "overlaps")
    _one_line_error(run_cli("-q", "convert", str(ckpt), str(ckpt / "data" / "x"), "--to", "hf"), "overlaps")
    os.symlink(ckpt, tmp_path / "alias")
    _one_line_error(run_cli("-q", "reshard", str(tmp_path / "alias"), str(ckpt), "--world-size", "2",
                            "--overwrite"), "overlaps")
    after = {p.name: p.read_bytes() for p in [ckpt / "manifest.json", *sorted((ckpt / "data").iterdir())]}
    assert after == before and not (ckpt / "data" / "x").exists()
    copy = tmp_path / "copy.pt"
    shutil.copy(src, copy)
    _one_line_error(run_cli("-q", "convert", str(copy), str(copy), "--to", "torch", "--overwrite"), "overlaps")
    assert copy.read_bytes() == src.read_bytes()


def test_torch_output_into_a_directory_and_native_output_onto_a_file_are_refused(tmp_path, native):
    src, out = native
    folder = tmp_path / "folder"
    folder.mkdir()
    _one_line_error(run_cli("-q", "convert", str(src), str(folder), "--to", "torch", "--overwrite"),
                    "is a directory")
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    _one_line_error(run_cli("-q", "reshard", str(out), str(existing), "--world-size", "2", "--overwrite"),
                    "is a file")
    assert existing.read_text() == "keep me"


def test_a_storage_failure_is_reported_as_such_not_as_a_missing_or_unknown_checkpoint(monkeypatch):
    from shardkit.checkpoint.formats import detect_format as detect
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.errors import StorageError

    storage = Storage("memory://engine-probe/ckpt")
    storage.put_atomic("notes.txt", b"not a checkpoint")  # it exists: only the failing call may say otherwise

    def forbidden(*args, **kwargs):
        raise PermissionError("403 Forbidden")

    for method in ("exists", "isdir"):
        with monkeypatch.context() as m:
            m.setattr(storage.fs, method, forbidden)
            with pytest.raises(StorageError, match="permission denied"):
                detect(storage)
