"""Writing HF, torch.save and DCP output, and verifying DCP, stay within --max-memory + 256 MiB of peak
RSS although the one tensor is several times the budget and is stored as a single DCP chunk.

Each command runs in a fresh interpreter that reports its own high-water mark (VmHWM) at exit, so
the figure is exact and includes the interpreter and torch themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardkit.checkpoint.formats import open_reader
from shardkit.checkpoint.formats.base import read_box

MiB = 1 << 20
BUDGET = 16 * MiB
ROWS, COLS = 16384, 1024  # 64 MiB of fp32: one tensor, four times the budget

_REPORTING_CLI = """
import atexit, os, sys
def _report():
    with open("/proc/self/status") as f, open(os.environ["SHARDKIT_TEST_HWM"], "w") as out:
        out.write(next(line for line in f if line.startswith("VmHWM:")).split()[1])
atexit.register(_report)
from shardkit.cli.main import main
main(sys.argv[1:])
"""


def _peak_rss(tmp_path, *args: str) -> int:
    """Peak RSS in bytes of ``shardkit ARGS`` run in a fresh interpreter; the command must succeed."""
    report = tmp_path / "hwm"
    env = {**os.environ, "SHARDKIT_TEST_HWM": str(report)}
    proc = subprocess.run([sys.executable, "-c", _REPORTING_CLI, "-q", *args], env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    return int(report.read_text()) * 1024


@pytest.fixture(scope="module")
def big_dcp(tmp_path_factory):
    """A DCP directory written by torch's own dcp.save: one 64 MiB tensor in one chunk."""
    import torch.distributed.checkpoint as dcp

    big = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("mem") / "dcp"
    dcp.save({"model": {"embed": big, "scale": torch.ones(3)}}, checkpoint_id=str(path), no_dist=True)
    return str(path), big[::997].clone()


@pytest.mark.parametrize("to", ["dcp", "hf", "torch"])
def test_convert_of_a_tensor_4x_the_budget_stays_within_budget_plus_256mib(tmp_path, big_dcp, to):
    src, sample = big_dcp
    out = str(tmp_path / ("out.pt" if to == "torch" else "out"))
    peak = _peak_rss(tmp_path, "convert", src, out, "--to", to, "--max-memory", "16MiB")
    assert peak <= BUDGET + 256 * MiB, f"--to {to}: peak RSS {peak / MiB:.0f} MiB > 16 MiB + 256 MiB"
    with open_reader(out) as reader:  # spot check: every 997th row, read by ranges
        got = read_box(reader, "model.embed")[::997]
    assert torch.equal(got, sample)


def test_verify_of_a_dcp_chunk_4x_the_budget_streams_it(tmp_path, big_dcp):
    src, _ = big_dcp
    peak = _peak_rss(tmp_path, "verify", src)
    assert peak <= BUDGET + 256 * MiB, f"verify: peak RSS {peak / MiB:.0f} MiB > 16 MiB + 256 MiB"
