"""Run the ``shardkit`` command in-process (as the console script would) and capture its output."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


def run_cli(*args: str) -> CliResult:
    """``shardkit *args`` through :func:`shardkit.cli.main.main`; returns exit code, stdout, stderr."""
    from shardkit.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return CliResult(code, out.getvalue(), err.getvalue())
