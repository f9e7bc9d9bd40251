"""Ctrl-C: exit 130 with one line; a command whose rerun resumes says so, and no other claims it.

The console script stops within 2 s of Ctrl-C on local disk and on S3 (moto), even while its workers are
stuck inside requests (``tests/support/exit_interrupt_cli.py``), and a rerun resumes and verifies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardkit.checkpoint.formats.native.ownership import RESUME_DIR
from shardkit.checkpoint.formats.native.writer import NativeWriter
from tests.support.offline_cli import run_cli

RESUMES = "rerunning the same command resumes"
SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture
def hf(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    # 1 MiB each: with zstd and a 16 MiB budget, files are capped at 1 MiB, so even one rank gets two files
    save_file({"a": torch.randn(512, 512), "b": torch.randn(512, 512)}, str(src / "model.safetensors"))
    return src


def _ctrl_c_on_the_second_file(monkeypatch):
    write_file, calls = NativeWriter.write_file, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return write_file(self, *args, **kwargs)

    monkeypatch.setattr(NativeWriter, "write_file", interrupted)


@pytest.mark.parametrize("command", [["reshard", "--world-size", "2"], ["convert", "--to", "shardkit"]])
def test_ctrl_c_during_native_output_says_a_rerun_resumes_and_the_rerun_does(hf, tmp_path, monkeypatch, command):
    dst = tmp_path / "dst"
    args = [command[0], str(hf), str(dst), *command[1:], "--workers", "1", "--max-memory", "16MiB",
            "--compression", "zstd"]
    with monkeypatch.context() as patch:
        _ctrl_c_on_the_second_file(patch)
        result = run_cli(*args)
    assert result.exit_code == 130
    assert result.stderr.strip().splitlines()[-1] == (
        "error: interrupted; rerunning the same command resumes (the data files already written are verified "
        "and kept)")
    assert not (dst / "manifest.json").exists()
    rerun = run_cli(*args)
    assert rerun.exit_code == 0, rerun.stderr
    assert "of tensor data already there, kept" in rerun.stderr


def test_ctrl_c_during_hf_output_does_not_claim_a_rerun_resumes(hf, tmp_path, monkeypatch):
    import shardkit.checkpoint.formats.hf.writer as hf_format

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_format, "write_hf", interrupted)
    result = run_cli("convert", str(hf), str(tmp_path / "dst"), "--to", "hf")
    assert result.exit_code == 130
    assert result.stderr.strip().splitlines()[-1] == "error: interrupted"
    assert RESUMES not in result.stderr


STUCK_S = 20.0  # how long each later data file's write hangs in its worker (a request that does not answer)
STOPS_WITHIN_S = 2.0
WRITERS = 3  # with --max-memory 64MiB the plan runs 3 writer threads (4 MiB chunks): Ctrl-C lands on the main thread


@pytest.fixture
def hf_in_files(tmp_path):
    """8 MiB in 1 MiB tensors: with 4 MiB files, two or more data files per output, written by worker threads."""
    src = tmp_path / "hf8"
    src.mkdir()
    generator = torch.Generator().manual_seed(0)
    save_file({f"w{i}": torch.randn(512, 512, generator=generator) for i in range(8)}, str(src / "model.safetensors"))
    return src


def _interrupt_while_writing(args: list[str], journal_appeared, tmp_path) -> tuple[int, float, str]:
    """Run ``shardkit *args`` as the console script with later writes stuck, Ctrl-C it once the first data
    file is journaled; return (exit code, seconds from SIGINT to exit, stderr)."""
    err = tmp_path / "interrupted.err"
    with err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, str(SUPPORT / "exit_interrupt_cli.py"), str(STUCK_S), *args],
                                stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline = time.monotonic() + 120
            while not journal_appeared():
                assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
                time.sleep(0.05)
            time.sleep(0.3)  # the workers are now inside their stuck writes
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=STUCK_S + 30)
            took = time.monotonic() - sent
        finally:
            proc.kill()
    return code, took, err.read_text()


def _ctrl_c_stops_within_two_seconds_and_a_rerun_finishes(src, dst: str, options: list[str], journal_appeared,
                                                          command: list[str], tmp_path) -> None:
    """``options``: the storage options of DST (verify takes them too)."""
    args = [command[0], str(src), dst, *command[1:], "--workers", str(WRITERS), "--max-memory", "64MiB",
            "--compression", "zstd", *options]
    code, took, stderr = _interrupt_while_writing(args, journal_appeared, tmp_path)
    assert code == 130, stderr[-2000:]
    print(f"SIGINT to exit: {took:.2f} s")
    assert took < STOPS_WITHIN_S, (took, stderr[-2000:])
    assert stderr.strip().splitlines()[-1].startswith("error: interrupted; rerunning the same command resumes")
    rerun = run_cli(*args)
    assert rerun.exit_code == 0, rerun.stderr
    assert "of tensor data already there, kept" in rerun.stderr
    verified = run_cli("verify", dst, *options)
    assert verified.exit_code == 0, verified.stderr
    assert verified.stdout.startswith("ok: shardkit checkpoint")


@pytest.mark.parametrize("command", [["reshard", "--world-size", "2"], ["convert", "--to", "shardkit"]])
def test_ctrl_c_stops_a_local_write_within_two_seconds_and_the_rerun_resumes(hf_in_files, tmp_path, command):
    dst = tmp_path / "dst"
    _ctrl_c_stops_within_two_seconds_and_a_rerun_finishes(
        hf_in_files, str(dst), [], lambda: any((dst / RESUME_DIR).glob("*")), command, tmp_path)


@pytest.mark.parametrize("command", [["reshard", "--world-size", "2"], ["convert", "--to", "shardkit"]])
def test_ctrl_c_stops_an_s3_write_within_two_seconds_and_the_rerun_resumes(hf_in_files, tmp_path, s3_url, command):
    import s3fs

    bucket, options = s3_url
    fs = s3fs.S3FileSystem(**options)
    dst = f"{bucket}/dst"
    endpoint = options["client_kwargs"]["endpoint_url"]
    cli_options = ["--storage-option", "key=testing", "--storage-option", "secret=testing",
                   "--storage-option", f"client_kwargs.endpoint_url={endpoint}"]

    def journal_appeared() -> bool:
        fs.invalidate_cache()
        return bool(fs.glob(f"{dst[len('s3://'):]}/{RESUME_DIR}/*"))

    _ctrl_c_stops_within_two_seconds_and_a_rerun_finishes(hf_in_files, dst, cli_options, journal_appeared, command,
                                                          tmp_path)
