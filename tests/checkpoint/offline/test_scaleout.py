"""Scale-out: ``torchrun -m shardkit reshard`` splits the output files across processes (balanced by
bytes) and writes the same checkpoint a single process writes."""

from __future__ import annotations

import json

import torch

from shardkit.checkpoint import diff, reshard, verify
from shardkit.checkpoint.formats.native.resumable import FileUnit, assign_units
from tests.support.dist import run_torchrun
from tests.support.offline_cli import run_cli
from tests.support.offline_helpers import write_torch_state


def test_units_are_balanced_by_bytes_largest_first():
    units = [FileUnit(f"data/x-{i}-0.safetensors", i, (), n) for i, n in enumerate([90, 10, 50, 40, 30, 30])]
    shares = assign_units(units, 2)
    loads = [sum(units[i].nbytes for i in share) for share in shares]
    assert sorted(i for share in shares for i in share) == list(range(6))
    assert loads == [120, 130] or loads == [130, 120]


def test_torchrun_reshard_splits_work_and_matches_one_process(tmp_path):
    gen = torch.Generator().manual_seed(0)
    flat = {f"model.w{i}": torch.randn(301, 64, generator=gen) for i in range(5)}
    flat["optim.state.w0.exp_avg"] = torch.randn(301, 64, generator=gen)
    src = write_torch_state(tmp_path / "src.pt", flat, [{"lr": 0.5, "params": ["w0"]}])
    single = str(tmp_path / "single")
    reshard(str(src), single, world_size=4)
    out = str(tmp_path / "scaled")
    done = run_torchrun("-m", 2, ["shardkit", "reshard", str(src), out, "--world-size", "4"], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reshard [0/2]" in done.stderr and "reshard [1/2]" in done.stderr  # both processes wrote files
    assert verify(out).ok and diff(single, out).equal
    manifest = json.loads(open(f"{out}/manifest.json").read())
    assert manifest["writer"]["world_size"] == 4 and {f["writer"] for f in manifest["files"].values()} == {0, 1, 2, 3}
    assert sorted(manifest["files"]) == sorted(json.loads(open(f"{single}/manifest.json").read())["files"])


def test_world_size_in_the_environment_alone_runs_one_process(tmp_path, monkeypatch):
    """A job environment (SLURM, a training pod) sets WORLD_SIZE/RANK without torchrun: convert alone."""
    flat = {"model.w": torch.randn(40, 8, generator=torch.Generator().manual_seed(0))}
    src = write_torch_state(tmp_path / "src.pt", flat, [])
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    result = run_cli("-q", "reshard", str(src), str(tmp_path / "out"), "--world-size", "2")
    assert result.exit_code == 0, result.stderr
    assert verify(str(tmp_path / "out")).ok and diff(str(src), str(tmp_path / "out")).equal
    result = run_cli("-q", "convert", str(src), str(tmp_path / "out2"), "--to", "shardkit", "--from", "torch")
    assert result.exit_code == 0, result.stderr


def test_distributed_without_a_launcher_is_a_one_line_error(tmp_path, monkeypatch):
    flat = {"model.w": torch.randn(40, 8, generator=torch.Generator().manual_seed(0))}
    src = write_torch_state(tmp_path / "src.pt", flat, [])
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    result = run_cli("-q", "reshard", str(src), str(tmp_path / "a"), "--world-size", "2", "--distributed")
    assert result.exit_code == 1 and result.stderr.startswith("error: ") and "torchrun" in result.stderr
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    result = run_cli("-q", "reshard", str(src), str(tmp_path / "b"), "--world-size", "2", "--distributed")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "torchrun" in result.stderr, result.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b" / "manifest.json").exists()
