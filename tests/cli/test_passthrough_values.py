"""The byte passthrough of ``reshard``/``convert`` takes exactly the values the click command takes: a
``--world-size`` (or ``--workers``, ``--retries``, ``--timeout``) the command refuses is left to click, so the
user gets click's own error and exit code and nothing is written; one it accepts is read as click reads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from shardkit.checkpoint import reshard as reshard_checkpoint
from shardkit.cli.conversion import convert, reshard
from shardkit.cli.passthrough import RETRIES, TIMEOUTS, WORKERS, WORLD_SIZES, passthrough_request
from tests.support.offline_helpers import write_torch_state

ROOT = Path(__file__).resolve().parents[2]
VALUES = ["3", "0012", "+3", " 3", "1_0", "1048576", "1048577", "99999999", "0", "-1", "²", "3.0", "x"]
# the click command alone: main.run, which the passthrough does not precede
CLICK_ONLY = ("import sys\nfrom shardkit.cli import main\nmain._register()\n"
              "sys.exit(main.run(sys.argv[1:], main.Settings(), None))")


def _param(command: click.Command, name: str) -> click.ParamType:
    return next(p.type for p in command.params if p.name == name)


def test_the_passthrough_types_its_values_as_the_commands_options_do():
    for ours, theirs in ((WORLD_SIZES, _param(reshard, "world_size")), (WORKERS, _param(reshard, "workers")),
                         (WORKERS, _param(convert, "workers")), (RETRIES, _param(reshard, "retries")),
                         (TIMEOUTS, _param(reshard, "timeout"))):
        assert type(ours) is type(theirs) and ours.to_info_dict() == theirs.to_info_dict()


def _accepted(kind: click.ParamType, value: str) -> object:
    try:
        return kind.convert(value, None, None)
    except click.BadParameter:
        return None


@pytest.mark.parametrize("value", VALUES)
def test_a_world_size_the_command_refuses_is_left_to_it_and_one_it_takes_is_read_as_it_reads_it(value):
    request = passthrough_request(["reshard", "src", "dst", "--world-size", value])
    expected = _accepted(_param(reshard, "world_size"), value)
    assert (request and request["world_size"]) == expected
    request = passthrough_request(["convert", "src", "dst", "--to", "shardkit", "--workers", value])
    assert (request and request["workers"]) == _accepted(_param(convert, "workers"), value)


@pytest.mark.parametrize("option,value", [("--retries", "101"), ("--retries", "²"), ("--timeout", "0"),
                                          ("--timeout", "-1"), ("--workers", "257")])
def test_other_values_the_command_refuses_are_left_to_it(option, value):
    assert passthrough_request(["reshard", "src", "dst", "--world-size", "2", option, value]) is None


def _cli(prefix: list[str], args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *prefix, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.parametrize("value", ["1048577", "99999999", "0", "²"])
def test_a_world_size_out_of_range_gets_the_click_commands_own_error_and_writes_nothing(tmp_path, value):
    import torch

    src = str(tmp_path / "src")
    reshard_checkpoint(str(write_torch_state(tmp_path / "state.pt", {"w": torch.ones(5, 3)}, [])), src, world_size=1)
    args = ["reshard", src, "dst", "--world-size", value]
    ours = _cli(["-m", "shardkit"], args, tmp_path)
    theirs = _cli(["-c", CLICK_ONLY], args, tmp_path)
    assert ours.returncode == theirs.returncode == 2  # click's usage error
    assert ours.stderr == theirs.stderr and "--world-size" in ours.stderr and ours.stdout == theirs.stdout
    assert not (tmp_path / "dst").exists()
