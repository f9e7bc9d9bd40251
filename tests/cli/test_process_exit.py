"""The ``shardkit`` process ends as soon as its command is done, its output whole and its exit code kept.

The console script skips the interpreter's teardown (``os._exit`` after a
flush): these tests run the real process and pin that nothing it printed is
lost, that the exit codes are the documented ones, that a reader that stops
early is no error, and that what a reshard wrote is committed and loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardkit.cli.exit_codes import ExitCode
from tests.support.offline_helpers import torch_and_native


def _shardkit(*words: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardkit", *words], capture_output=True, text=True,
                          cwd=os.getcwd(), timeout=300, **kwargs)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return torch_and_native(tmp_path_factory.mktemp("process_exit"))[1]


def test_the_json_of_inspect_reaches_a_pipe_whole_and_the_exit_code_is_0(native):
    done = _shardkit("inspect", str(native), "--json")
    assert done.returncode == ExitCode.OK, done.stderr
    described = json.loads(done.stdout)  # the whole document: a lost tail would not parse
    assert described["format"] == "shardkit" and described["totals"]["tensors"] > 0


def test_a_checkpoint_problem_still_exits_1_with_its_one_line_error(tmp_path):
    done = _shardkit("inspect", str(tmp_path / "nothing-here"))
    assert done.returncode == ExitCode.CHECKPOINT
    assert done.stderr.strip().splitlines()[-1].startswith("error: ")


def test_a_usage_error_still_exits_2(native):
    done = _shardkit("reshard", str(native))
    assert done.returncode == ExitCode.USAGE, done.stderr


def test_a_reader_that_stops_early_is_no_error(native):
    cmd = f"{sys.executable} -m shardkit inspect {native} --json | head -c 1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, cwd=os.getcwd(),
                          timeout=300)
    assert done.stdout == "{"
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_a_reshard_run_as_a_process_is_committed_and_verifies_when_the_process_ends(native, tmp_path):
    out = tmp_path / "ws3"
    done = _shardkit("-q", "reshard", str(native), str(out), "--world-size", "3")
    assert done.returncode == ExitCode.OK, done.stderr
    assert done.stdout == "" and "error" not in done.stderr, done.stderr
    checked = _shardkit("verify", str(out))
    assert checked.returncode == ExitCode.OK, checked.stderr
