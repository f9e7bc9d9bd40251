"""``benchmarks/peers.py --device cuda`` checked as far as a machine without a GPU can: its command line, its
clear exit without CUDA, the rank count it picks from the GPUs it finds, the CUDA configuration of each
system (pinned staging for all three; torch_checkpointing's direct I/O only where its write works) and the
``FIGURE`` lines ``benchmarks/gpu_check.sh`` collects, with what one GPU cannot run said NOT VERIFIED.
The CUDA runs themselves happen in ``gpu_check.sh`` on a machine with a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peers():
    path = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("peers_under_test", ROOT / "benchmarks" / "peers.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path  # the benchmark puts its own folder first
    return module


def test_the_device_is_the_cpu_unless_cuda_is_asked_for(peers):
    assert peers.parse_args(["--sizes", "5MB"]).device == "cpu"
    assert peers.parse_args(["--device", "cuda", "--sizes", "50MB,1GB", "--rounds", "3"]).device == "cuda"
    with pytest.raises(SystemExit) as bad:
        peers.parse_args(["--device", "tpu"])
    assert bad.value.code == 2


def test_a_size_that_is_not_one_is_refused_before_any_job_starts(peers, capsys):
    with pytest.raises(SystemExit) as bad:
        peers.parse_args(["--sizes", "50MB,lots"])
    assert bad.value.code == 2
    assert "--sizes" in capsys.readouterr().err


def test_cuda_without_a_gpu_exits_saying_so_and_starts_no_job(peers, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(peers.subprocess, "run", lambda *a, **k: pytest.fail("a job was started"))
    monkeypatch.setattr(sys, "argv", ["peers.py", "--device", "cuda", "--sizes", "5MB"])
    with pytest.raises(SystemExit) as exit_:
        peers.main()
    assert str(exit_.value) == ("--device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                                "run it on a GPU machine (benchmarks/gpu_check.sh does), or with --device cpu")


@pytest.mark.parametrize("gpus,ranks", [(1, 1), (2, 2), (8, 2)])
def test_the_sharded_job_takes_one_gpu_per_rank_and_at_most_two(peers, monkeypatch, gpus, ranks):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert peers.cuda_world() == ranks


def test_on_cuda_torch_checkpointing_stages_into_pinned_memory_and_uses_direct_io_only_when_told(peers):
    ps = peers.ps
    config = ps.tc_config(True, "cuda", direct_io=True)
    staging = config.save.staging_config
    assert (staging.use_pinned_memory, staging.use_shared_memory, staging.use_async_staging,
            staging.use_non_blocking_copy) == (True, True, True, True)
    assert config.storage_config.use_direct_io is True
    assert ps.tc_config(False, "cuda", direct_io=False).storage_config.use_direct_io is False
    cpu = ps.tc_config(True, "cpu", direct_io=True)  # the CPU configuration is what it was
    assert cpu.storage_config.use_direct_io is False
    assert cpu.save.process_config.subprocess_init_timeout_secs == 300


def test_the_direct_io_probe_answers_and_leaves_nothing_behind(peers, tmp_path):
    assert peers.ps.tc_direct_io_works(str(tmp_path)) in (True, False)
    assert os.listdir(tmp_path) == []


def test_the_direct_io_probe_says_no_where_the_write_is_refused(peers, tmp_path, monkeypatch):
    from torch_checkpointing.storage import filesystem

    def refused(self, *args, **kwargs):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(filesystem.WriteStream, "write", refused)
    assert peers.ps.tc_direct_io_works(str(tmp_path)) is False
    assert os.listdir(tmp_path) == []


def test_every_verdict_becomes_a_figure_line_and_one_gpu_says_what_it_did_not_run(peers, capsys):
    verdicts = [peers.targets.Verdict("50MB save, durable: shardkit / best peer (DCP)", 0.8, 1.0, "x"),
                peers.targets.Verdict("1GB load, 1 rank, cold: shardkit / best peer (DCP)", 1.3, 1.0, "y")]
    peers.print_figures(verdicts, world=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "FIGURE CUDA 50MB save, durable: shardkit / best peer (DCP): 0.80 (<= 1.00) MET",
        "FIGURE CUDA 1GB load, 1 rank, cold: shardkit / best peer (DCP): 1.30 (<= 1.00) MISSED",
        "FIGURE CUDA save, load and async save at 2 ranks, and the resharding load from 2 ranks: NOT VERIFIED: "
        "one GPU (NCCL takes one GPU per rank), so the sharded job ran at 1 rank"]
    peers.print_figures(verdicts, world=2)
    assert "NOT VERIFIED" not in capsys.readouterr().out


def test_a_one_rank_run_is_labelled_as_one_rank_not_as_a_resharding(peers, capsys):
    row = {f"{op}/{s}": 1.0 for op, _ in peers.OPS for s in peers.ps.SYSTEMS}
    row.update({"save/raw": 1.0, "load2/raw": 1.0, "load1/raw": 1.0})
    result = {"rank_bytes": 1000, "shape": [128, 320, 3], "rounds": [row], "evicted_by": "fadvise", "world": 1}
    args = peers.parse_args(["--warmup", "0", "--rounds", "1"])
    names = [v.name for v in peers.report({"5MB": result}, args)]
    assert names == ["5MB save, durable: shardkit / best peer (DCP)",
                     "5MB load, 1 rank, cold: shardkit / best peer (DCP)",
                     "5MB load at 1 process (from 1 rank), cold: shardkit / best peer (DCP)",
                     "5MB async save, blocking: shardkit / best peer (DCP)"]
    assert "load, 2 ranks" not in capsys.readouterr().out
