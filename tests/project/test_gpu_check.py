"""``benchmarks/gpu_check.sh``, the one command for a GPU machine, pinned down on a machine without one.

A GPU machine is lent for minutes at a time, so the check must not fail
there on something a CPU could have caught: without a CUDA device it skips
every step, says why, and exits 0 at once; and every Python command it runs
parses its arguments (checked here with the very arguments the script
passes).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ["machine", "cuda-tests", "runtime-world1", "runtime-world2", "checkpoint-cuda", "nccl-shared-reads",
         "peers-cuda"]
NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"


def test_without_a_gpu_every_step_is_skipped_with_the_reason_and_the_check_exits_0_quickly(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert seconds < 60
    report = (tmp_path / "gpu_check_report.txt").read_text().splitlines()
    steps = report[report.index("steps") + 1:report.index("figures") - 1]
    assert steps == [f"  {name}: SKIPPED: {NO_GPU}" for name in STEPS]
    assert report[report.index("figures") + 1] == "  none (every step was skipped)"
    assert report[-1] == "0 MET, 0 MISSED; 0 step(s) failed"
    assert (tmp_path / "gpu_check.log").exists()


def _python_commands() -> list[tuple[str, list[str]]]:
    """(script, arguments) of every ``$PY benchmarks/....py`` command in the check, its variables given
    the check's defaults."""
    text = SCRIPT.read_text()
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}$", text, re.M))
    commands = []
    for script, rest in re.findall(r"\$PY (benchmarks/\w+\.py)([^\n]*)", text):
        args = [re.sub(r"\$(\w+)", lambda m: defaults[m.group(1)], arg) for arg in shlex.split(rest)]
        commands.append((script, args))
    return commands


def test_the_check_runs_the_three_benchmarks_and_the_cuda_marked_test_files():
    assert [script for script, _ in _python_commands()] == [
        "benchmarks/runtime.py", "benchmarks/runtime.py", "benchmarks/checkpoint_cuda.py",
        "benchmarks/shared_reads_nccl.py", "benchmarks/peers.py"]
    marked = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
                    if re.search(r"^(pytestmark = |@)pytest\.mark\.cuda", p.read_text(), re.M))
    assert {"tests/checkpoint/training/test_cuda.py", "tests/runtime/test_cuda.py",
            "tests/checkpoint/training/test_shared_reads_cuda.py"} <= set(marked)
    (selection,) = re.findall(r"-m cuda \$\((grep .*)\)$", SCRIPT.read_text(), re.M)
    found = subprocess.run(["bash", "-c", selection], cwd=ROOT, capture_output=True, text=True, check=True)
    assert found.stdout.split() == marked


@pytest.mark.parametrize("script,args", _python_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_benchmark_the_check_runs_accepts_the_arguments_it_is_given(script, args):
    path = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location(Path(script).stem + "_under_test", ROOT / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path  # the benchmarks put their own folder first
    parsed = module.parse_args(args)
    for flag, value in zip(args[::2], args[1::2]):  # the check passes "--name value" pairs only
        got = getattr(parsed, flag.removeprefix("--").replace("-", "_"))
        assert got == type(got)(value), (flag, value, got)
    with pytest.raises(SystemExit) as help_exit:
        module.parse_args(["--help"])
    assert help_exit.value.code == 0


def test_on_one_gpu_the_nccl_shared_read_is_reported_not_verified_with_the_reason(tmp_path):
    fake = tmp_path / "python"  # a machine with one GPU, where every command succeeds at once
    fake.write_text("#!/bin/bash\ncase \"$*\" in *device_count*) echo 1 ;; esac\nexit 0\n")
    fake.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": str(fake)}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    report = (tmp_path / "gpu_check_report.txt").read_text().splitlines()
    reason = "one GPU: NCCL between ranks needs 2, so shared reads over NCCL did not run"
    assert f"  nccl-shared-reads: NOT VERIFIED: {reason}" in report, proc.stdout
    assert f"  [nccl-shared-reads] NOT VERIFIED: {reason}" in report
    assert not any(line.startswith("  nccl-shared-reads: SKIPPED") for line in report)
