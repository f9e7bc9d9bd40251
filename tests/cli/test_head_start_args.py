"""What the ``shardkit`` process reads off its command line before it loads the engine, to start fetching a
reshard's or a convert's source (the head start): SRC and its storage options exactly as the command will
build them, and nothing guessed from a line it does not fully know."""

from __future__ import annotations

import click
import pytest

from shardkit.checkpoint.offline.options import DEFAULT_WORKERS
from shardkit.cli.conversion import convert, reshard
from shardkit.cli.main import FLAG_OPTIONS, VALUE_OPTIONS, head_start_request, hoist_global_flags


@pytest.mark.parametrize("command", [reshard, convert], ids=["reshard", "convert"])
def test_every_option_of_the_command_is_known_with_whether_it_takes_a_value(command):
    for param in command.params:
        if not isinstance(param, click.Option):
            continue
        names = set(param.opts) | set(param.secondary_opts)
        long = {n for n in names if n.startswith("--")} - {"--help"}
        known = VALUE_OPTIONS if not (param.is_flag or param.count) else FLAG_OPTIONS
        assert long <= known, (command.name, sorted(long))


def test_src_its_storage_options_the_budget_and_the_workers_are_read_as_the_command_reads_them():
    line = ["-q", "reshard", "--world-size", "3", "s3://a/ckpt", "--storage-option=client_kwargs.endpoint_url=http://x",
            "s3://b/out", "--retries", "5", "--max-memory", "1GiB", "--overwrite", "--dst-storage-option", "anon:=true",
            "--storage-option", "anon:=false", "--timeout=3", "--workers", "8"]
    assert head_start_request(hoist_global_flags(line)) == (
        "s3://a/ckpt", ["client_kwargs.endpoint_url=http://x", "anon:=false", "shardkit.retries:=5",
                        "shardkit.timeout:=3"], "1GiB", 8)
    assert head_start_request(["convert", "s3://a/x", "out", "--to", "shardkit"]) == (
        "s3://a/x", [], None, DEFAULT_WORKERS)


@pytest.mark.parametrize("line", [
    ["inspect", "s3://a/ckpt"],
    ["reshard", "s3://a/ckpt", "s3://b/out", "--help"],
    ["reshard", "s3://a/ckpt", "s3://b/out", "--distributed", "--world-size", "2"],
    ["reshard", "s3://a/ckpt", "s3://b/out", "--new-option", "x"],
    ["reshard", "s3://a/ckpt", "--world-size"],
    ["reshard", "s3://a/ckpt", "--world-size", "3"],
], ids=["other-command", "help", "distributed", "unknown-option", "missing-value", "no-dst"])
def test_nothing_is_guessed_from_a_line_it_does_not_fully_know(line):
    assert head_start_request(line) is None


def test_no_head_start_under_torchrun(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert head_start_request(["reshard", "s3://a/ckpt", "s3://b/out", "--world-size", "2"]) is None


def test_a_workers_value_click_refuses_starts_no_head_start():
    assert head_start_request(["reshard", "s3://a/x", "b", "--workers", "²"]) is None
