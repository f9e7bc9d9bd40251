"""What ``--help`` says: each command's options name only the locations that command has, and the
top-level help lists every format the registry knows."""

from __future__ import annotations

import re

import pytest

from shardkit.checkpoint.formats import FORMATS
from tests.support.offline_cli import run_cli


def _unwrapped(help_text: str) -> str:
    """The help as one line: click wraps option help at spaces and after hyphens (``--dst-`` / ``storage``)."""
    return re.sub(r"(?<=\w-) (?=\w)", "", " ".join(help_text.split()))


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_help_of_a_one_location_command_names_src_and_no_dst(command):
    result = run_cli(command, "--help")
    assert result.exit_code == 0
    text = _unwrapped(result.stdout)
    assert "fsspec option for SRC; repeatable." in text
    assert "DST" not in text and "--dst-storage-option" not in text


def test_diff_help_names_a_and_b_not_src_and_dst():
    result = run_cli("diff", "--help")
    assert result.exit_code == 0
    text = _unwrapped(result.stdout)
    assert "fsspec option for A (and B unless --b-storage-option); repeatable." in text
    assert "DST" not in text and "SRC" not in text and "--dst-storage-option" not in text


@pytest.mark.parametrize("command", ["reshard", "convert"])
def test_help_of_a_writing_command_names_src_and_dst(command):
    text = _unwrapped(run_cli(command, "--help").stdout)
    assert "fsspec option for SRC (and DST unless --dst-storage-option); repeatable." in text
    assert "--dst-storage-option KEY=VALUE fsspec option for DST only; repeatable." in text


def test_top_level_help_lists_every_registered_format_with_its_description():
    result = run_cli("--help")
    assert result.exit_code == 0
    lines = [line.split() for line in result.stdout.splitlines()]
    for name, fmt in FORMATS.items():
        assert [name, *fmt.description.split()] in lines, name
    assert {"deepspeed", "trainer"} <= set(FORMATS)


def test_convert_help_says_one_shard_is_model_safetensors_alone_and_several_have_an_index():
    text = _unwrapped(run_cli("convert", "--help").stdout)
    assert ("HF output is one model.safetensors when the weights fit in one shard (--max-shard-size), else "
            "size-capped shards + model.safetensors.index.json,") in text
    assert "an index" not in text
