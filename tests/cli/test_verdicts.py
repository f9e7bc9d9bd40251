"""No false pass: diff and verify give a verdict only on what they really compared and checked,
and each command says truthfully what it did."""

from __future__ import annotations

import json
import shutil

import pytest

from shardkit.checkpoint import convert, diff, reshard
from shardkit.checkpoint.offline.progress import Progress
from tests.support.offline_cli import run_cli
from tests.support.offline_helpers import torch_and_native


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return torch_and_native(tmp_path_factory.mktemp("verdicts"))


@pytest.mark.parametrize("filters", [["--only", "nothing.*"], ["--exclude", "*"],
                                     ["--only", "model.*", "--exclude", "model.*"]])
def test_diff_refuses_filters_that_select_nothing(pair, filters):
    src, native = pair
    result = run_cli("diff", str(src), str(native), *filters)
    assert result.exit_code == 1, result.stdout
    assert "keep no tensor" in result.stderr and "equal" not in result.stdout


@pytest.mark.parametrize("option", ["--atol", "--rtol"])
def test_diff_refuses_a_negative_tolerance(pair, option):
    src, native = pair
    result = run_cli("diff", str(src), str(native), option, "-1e-3")
    assert result.exit_code == 1 and option in result.stderr and "non-negative" in result.stderr


def test_diff_against_a_model_only_export_compares_the_model_part_and_says_so(pair, tmp_path):
    src, native = pair
    hf = tmp_path / "hf"
    convert(str(native), str(hf), to="hf")
    result = run_cli("diff", str(native), str(hf))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "note: comparing model.* only" in result.stderr
    report = diff(str(native), str(hf))
    assert report.equal and report.tensors and all(t.name.startswith("model.") for t in report.tensors)


def test_diff_progress_reaches_the_whole_when_the_sides_differ_in_dtype(pair, tmp_path):
    src, native = pair
    half = tmp_path / "bf16"
    convert(str(native), str(half), to="shardkit", dtype="bf16")
    progress = Progress(stream=None)
    report = diff(str(native), str(half), only=["model.*"], atol=1.0, rtol=1.0, progress=progress)
    assert report.equal and any("dtype" in t.detail for t in report.tensors)
    assert progress.total > 0 and progress.done == progress.total


def test_verify_prints_each_problem_once(pair, tmp_path):
    _, native = pair
    bad = tmp_path / "bad"
    shutil.copytree(native, bad)
    for victim in (bad / "data").iterdir():
        victim.write_bytes(victim.read_bytes()[:-5])
    result = run_cli("verify", str(bad))
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("damaged: ")]
    assert len(lines) == len(set(lines)) == 2
    for line in lines:  # the summary line counts the problems; it does not repeat one of them
        assert sum(line[len("damaged: "):] in other for other in result.stderr.splitlines()) == 1
    assert result.stderr.splitlines()[-1].endswith("2 problems, listed above")


def test_convert_to_shardkit_names_itself_convert_in_progress_and_manifest(pair, tmp_path):
    src, _ = pair
    out = tmp_path / "out"
    result = run_cli("convert", str(src), str(out), "--to", "shardkit")
    assert result.exit_code == 0, result.stderr
    assert "convert → shardkit" in result.stderr and "reshard" not in result.stderr
    assert json.loads((out / "manifest.json").read_text())["writer"]["tool"] == "shardkit convert"
    resharded = tmp_path / "resharded"
    reshard(str(src), str(resharded), world_size=2)
    assert json.loads((resharded / "manifest.json").read_text())["writer"]["tool"] == "shardkit reshard"

