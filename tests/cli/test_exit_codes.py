"""Each row of the exit-code table in docs/cli.md is what the command returns in that case."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardkit.cli.exit_codes import ExitCode
from tests.support.offline_cli import run_cli
from tests.support.offline_helpers import torch_and_native

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return torch_and_native(tmp_path_factory.mktemp("exit_codes"))[1]


def test_the_documented_table_is_the_enum():
    section = DOCS.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", section, flags=re.M)
    assert [(int(code), name) for code, name in rows] == [(code.value, code.name) for code in ExitCode]


def test_ok_is_0(native):
    assert run_cli("verify", str(native)).exit_code == ExitCode.OK == 0


def test_a_checkpoint_problem_is_1(tmp_path):
    result = run_cli("inspect", str(tmp_path / "nothing-here"))
    assert result.exit_code == ExitCode.CHECKPOINT == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")


def test_damage_found_by_verify_is_1(native, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(native, damaged)
    data = sorted((damaged / "data").iterdir())[0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert run_cli("verify", str(damaged)).exit_code == ExitCode.CHECKPOINT


@pytest.mark.parametrize("args", [["verify", "--no-such-option", "x"], ["verify"], ["no-such-command"],
                                  ["verify", "x", "--workers", "0"]])
def test_a_wrong_command_line_is_2(args):
    result = run_cli(*args)
    assert result.exit_code == ExitCode.USAGE == 2, result.stderr
    assert "Usage:" in result.stderr or "Error:" in result.stderr


def test_an_unexpected_exception_is_3(native, monkeypatch):
    import shardkit.checkpoint.offline.convert as offline

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(offline, "verify", broken)
    result = run_cli("verify", str(native))
    assert result.exit_code == ExitCode.INTERNAL == 3
    assert result.stderr.strip().splitlines()[-1] == (
        "internal error: ZeroDivisionError: a bug (rerun with --debug for the traceback)")


def test_ctrl_c_is_130(native, monkeypatch):
    import shardkit.checkpoint.offline.convert as offline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(offline, "verify", interrupted)
    result = run_cli("verify", str(native))
    assert result.exit_code == ExitCode.INTERRUPTED == 130
    assert result.stderr.strip().splitlines()[-1] == "error: interrupted"
