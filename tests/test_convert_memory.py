"""Memory is bounded by --max-memory, not by the model: peak RSS <= budget + 256 MiB while
resharding a tensor several times larger than the budget (streamed in row blocks)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from shardkit.checkpoint import diff, reshard
from tests.offline_helpers import write_torch_state

MiB = 1 << 20


def _peak_rss(cmd: list[str]) -> tuple[int, int]:
    """(exit code, peak RSS bytes) of ``cmd``: its own VmHWM, sampled until it exits."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=os.getcwd())
    peak = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            pass
        time.sleep(0.005)
    return proc.returncode, peak


def test_reshard_of_a_tensor_8x_the_budget_stays_within_budget_plus_256mib(tmp_path):
    budget = 16 * MiB
    big = torch.randn(32768, 1024, generator=torch.Generator().manual_seed(0))  # 128 MiB, one tensor
    src_pt = write_torch_state(tmp_path / "big.pt", {"model.embed": big, "model.scale": torch.ones(3)}, [])
    native = str(tmp_path / "native")
    reshard(str(src_pt), native, world_size=1)
    del big
    # from a native source (ranged reads) and from a torch.save source (memory-mapped, pages released)
    for name, src in (("native", native), ("torch", str(src_pt))):
        out = str(tmp_path / f"out-{name}")
        code, peak = _peak_rss([sys.executable, "-m", "shardkit", "-q", "reshard", src, out, "--world-size", "3",
                                "--max-memory", "16MiB"])
        assert code == 0
        assert peak <= budget + 256 * MiB, f"{name}: peak RSS {peak / MiB:.0f} MiB > budget 16 MiB + 256 MiB"
        assert diff(native, out).equal
