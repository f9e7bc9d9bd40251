"""Cloud migration: local → S3 (moto on loopback) → local with a reshard on the way; a migration
killed midway resumes on rerun, finishes, and verify passes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardkit.checkpoint import diff, reshard, verify
from tests.support.offline_cli import run_cli
from tests.support.offline_helpers import model_and_moments, write_torch_state


def _cli_options(flag: str, options: dict) -> list[str]:
    out = []
    for key, value in options.items():
        if isinstance(value, dict):
            out += [item for k, v in value.items() for item in (flag, f"{key}.{k}={v}")]  # string values
        else:
            out += [flag, f"{key}={value}" if isinstance(value, str) else f"{key}:={json.dumps(value)}"]
    return out


@pytest.fixture(scope="module")
def local_ckpt(tmp_path_factory):
    """A 2-rank native checkpoint of ~16 MB (model + optimizer-like tensors, uneven rows)."""
    root = tmp_path_factory.mktemp("migrate")
    flat = model_and_moments(layers=6, rows=333)
    src = write_torch_state(root / "src.pt", flat, [{"lr": 0.1, "params": [f"layers.{i}.w" for i in range(6)]}])
    local = root / "local"
    reshard(str(src), str(local), world_size=2)
    return str(local)


def test_local_to_s3_to_local_with_a_reshard_on_the_way(local_ckpt, tmp_path, s3_url):
    bucket, options = s3_url
    remote = f"{bucket}/ckpt-ws4"
    result = run_cli("-q", "reshard", local_ckpt, remote, "--world-size", "4", "--workers", "4",
                     *_cli_options("--dst-storage-option", options))
    assert result.exit_code == 0, result.stderr
    report = verify(remote, storage_options=options)
    assert report.ok and report.bytes_checked > 15_900_000
    back = str(tmp_path / "back")
    result = run_cli("-q", "reshard", remote, back, "--world-size", "1", "--compression", "zstd",
                     *_cli_options("--storage-option", options), "--dst-storage-option", "auto_mkdir:=true")
    assert result.exit_code == 0, result.stderr
    assert diff(local_ckpt, back).equal
    assert diff(local_ckpt, remote, b_storage_options=options).equal


def _journal_count(fs, bucket: str, path: str) -> int:
    try:
        return len([p for p in fs.ls(f"{bucket}/{path}/.shardkit-resume", refresh=True) if p.endswith(".json")])
    except FileNotFoundError:
        return 0


def test_killed_migration_resumes_on_rerun_and_verifies(local_ckpt, s3_url):
    import s3fs

    bucket, options = s3_url
    remote = f"{bucket}/resumed"
    fs = s3fs.S3FileSystem(**options)  # one client for every poll: a new one per poll costs a core while it waits
    cmd = [sys.executable, "-m", "shardkit", "-q", "reshard", local_ckpt, remote, "--world-size", "32",
           "--workers", "1", *_cli_options("--dst-storage-option", options)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            cwd=os.getcwd())
    deadline = time.monotonic() + 60
    try:
        while _journal_count(fs, bucket[len("s3://"):], "resumed") < 1:
            assert proc.poll() is None, "the migration finished before it could be interrupted"
            assert time.monotonic() < deadline, "no file was written within 60 s"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done_before = _journal_count(fs, bucket[len("s3://"):], "resumed")
    assert 1 <= done_before < 32
    assert not fs.exists(f"{remote}/manifest.json")
    assert run_cli("-q", "verify", remote, *_cli_options("--storage-option", options)).exit_code == 1

    result = reshard(local_ckpt, remote, world_size=32, workers=4, dst_storage_options=options)
    assert result.skipped_bytes >= done_before * 400_000  # the files (each ~500 KB) written before the kill were kept
    assert verify(remote, storage_options=options).ok
    assert diff(local_ckpt, remote, b_storage_options=options).equal
    assert not fs.exists(f"{remote}/.shardkit-resume")


def test_cloud_migration_example_runs_against_a_local_s3_server():
    done = subprocess.run([sys.executable, "examples/cloud_migration.py"], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "verify s3://" in done.stdout and ": ok (" in done.stdout
    assert "bit-identical to the original: True" in done.stdout
