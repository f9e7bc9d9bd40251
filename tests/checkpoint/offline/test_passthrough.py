"""``reshard``/``convert --to shardkit`` of a native checkpoint stored as the output will be: its bytes are
passed through, without torch, into the very checkpoint the engine writes (same files, byte for byte, same
manifest); a damaged source byte fails it with DST as it was; a rerun resumes without reading back what
was written; and anything else -- a cast, a compressed source -- goes to the engine as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardkit.checkpoint.formats.native.resumable as native_resumable
import shardkit.checkpoint.offline.passthrough as passthrough_module
from shardkit.checkpoint import convert, diff, reshard
from shardkit.checkpoint.formats.native import NativeReader
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.offline.passthrough import eligible_manifest, passthrough
from shardkit.errors import ChecksumMismatch, CorruptCheckpoint
from tests.support.offline_helpers import write_torch_state

ROOT = Path(__file__).resolve().parents[3]


def _flat() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"model.w": torch.randn(301, 40, generator=gen), "model.b": torch.randn(7, generator=gen),
            "model.scale": torch.tensor(3.0), "model.none": torch.empty(0, 3),
            "optim.state.model.w.step": torch.tensor(5, dtype=torch.int64),
            "optim.state.model.w.exp_avg": torch.randn(301, 40, generator=gen)}


def _native(tmp_path: Path, ranks: int, **options) -> str:
    src = str(tmp_path / f"src-{ranks}")
    groups = [{"lr": 0.1, "params": ["model.w"]}]
    reshard(str(write_torch_state(tmp_path / "state.pt", _flat(), groups)), src, world_size=ranks, **options)
    return src


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("tool", ["reshard", "convert"])
def test_the_passthrough_writes_the_engines_checkpoint_byte_for_byte(tmp_path, tool, ranks):
    src = _native(tmp_path, ranks)
    kw = {"world_size": 3} if tool == "reshard" else {}
    ours = passthrough(src, str(tmp_path / "pt"), tool=tool, max_memory="16MiB", **kw)
    if tool == "reshard":
        theirs = reshard(src, str(tmp_path / "engine"), max_memory="16MiB", **kw)
    else:
        theirs = convert(src, str(tmp_path / "engine"), to="shardkit", max_memory="16MiB")
    assert ours.dst != theirs.dst and {**ours.__dict__, "dst": ""} == {**theirs.__dict__, "dst": ""}
    assert _files(tmp_path / "pt") == _files(tmp_path / "engine")  # data files and manifest alike
    assert diff(src, str(tmp_path / "pt")).equal


def test_the_command_line_runs_the_passthrough_and_reports_as_the_engine(tmp_path, capsys):
    from shardkit.cli.main import main

    src = _native(tmp_path, 2)
    with pytest.raises(SystemExit) as done:
        main(["reshard", src, str(tmp_path / "cli"), "--world-size", "3", "--max-memory", "16MiB"])
    assert done.value.code == 0
    assert "wrote shardkit checkpoint" in capsys.readouterr().err
    reshard(src, str(tmp_path / "engine"), world_size=3, max_memory="16MiB")
    assert _files(tmp_path / "cli") == _files(tmp_path / "engine")


def test_a_damaged_source_byte_fails_the_command_and_leaves_dst_as_it_was(tmp_path):
    src = _native(tmp_path, 1)
    dst = tmp_path / "dst"
    reshard(src, str(dst), world_size=2)
    before = _files(dst)
    victim = next((Path(src) / "data").iterdir())
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="does not match the manifest"):
        passthrough(src, str(dst), tool="reshard", world_size=3, overwrite=True)
    after = _files(dst)
    assert {name: after[name] for name in before} == before  # the old checkpoint, whole, its manifest first
    assert NativeReader(str(dst)).tensors().keys() == NativeReader(src).tensors().keys()


def test_a_truncated_source_file_fails_the_command_before_a_byte_is_written(tmp_path):
    src = _native(tmp_path, 1)
    victim = next((Path(src) / "data").iterdir())
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(CorruptCheckpoint, match="truncated or was replaced"):
        passthrough(src, str(tmp_path / "dst"), tool="convert")
    assert not list((tmp_path / "dst").rglob("*.safetensors"))


class _Interrupted(Exception):
    pass


def test_a_rerun_after_an_interrupt_resumes_without_reading_what_was_written(tmp_path, monkeypatch):
    src = _native(tmp_path, 1)
    dst = str(tmp_path / "dst")
    with monkeypatch.context() as m:
        m.setattr(native_resumable, "commit_resumable", lambda *a, **k: (_ for _ in ()).throw(_Interrupted()))
        with pytest.raises(_Interrupted):
            passthrough(src, dst, tool="reshard", world_size=3)
    reads = []
    real = passthrough_module.read_rows
    monkeypatch.setattr(passthrough_module, "read_rows", lambda *a: reads.append(a[1]) or real(*a))
    result = passthrough(src, dst, tool="reshard", world_size=3)
    assert reads == [] and result.skipped_bytes == result.bytes > 0
    assert diff(src, dst).equal


def test_what_the_passthrough_does_not_take_is_left_to_the_engine(tmp_path):
    compressed = _native(tmp_path, 1, compression="zstd")
    assert eligible_manifest(Storage(compressed)) is None
    assert passthrough(compressed, str(tmp_path / "x"), tool="reshard", world_size=2) is None
    assert not (tmp_path / "x").exists()
    assert eligible_manifest(Storage(_native(tmp_path, 2))) is not None


def _cli(args: list[str], cwd: Path, block_torch: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        ([str(cwd / "site")] if block_torch else []) + [str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "shardkit", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


BLOCK_TORCH = '''import sys


class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch may not be imported here")
        return None


sys.meta_path.insert(0, _Blocked())
'''


def test_the_passthrough_command_never_imports_torch_and_the_rest_still_runs(tmp_path):
    src = _native(tmp_path, 2)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK_TORCH)
    assert "torch may not be imported" in _cli(["inspect", src], tmp_path, block_torch=True).stderr
    for args in (["reshard", src, "a", "--world-size", "3"], ["convert", src, "b", "--to", "shardkit", "-q"]):
        done = _cli(args, tmp_path, block_torch=True)
        assert done.returncode == 0, done.stderr[-2000:]
    assert diff(src, str(tmp_path / "a")).equal and diff(src, str(tmp_path / "b")).equal
    cast = _cli(["reshard", src, "c", "--world-size", "3", "--dtype", "bf16"], tmp_path, block_torch=False)
    assert cast.returncode == 0, cast.stderr[-2000:]
    assert NativeReader(str(tmp_path / "c")).tensors()["model.w"].dtype == torch.bfloat16
    compressed = _native(tmp_path, 1, compression="zstd")
    done = _cli(["reshard", compressed, "d", "--world-size", "2"], tmp_path, block_torch=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert diff(compressed, str(tmp_path / "d")).equal
