"""Rendering for the ``shardkit`` command: tables, sizes, JSON, progress on stderr, and option parsing helpers."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, Sequence

import click

from shardkit.checkpoint.offline.progress import Progress, human_bytes, human_count

__all__ = ["table", "echo_json", "progress_unless_quiet", "report_written", "storage_options", "human_bytes",
           "human_count"]


def table(rows: Iterable[Sequence[Any]], header: Sequence[str], align: str = "") -> str:
    """A plain aligned text table; ``align`` holds 'l'/'r' per column (default left)."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [len(h) for h in header]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]
    align = align or "l" * len(header)

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(r, widths, align)).rstrip()

    return "\n".join([fmt(list(header)), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def progress_unless_quiet(ctx: click.Context) -> Progress | None:
    """The progress lines a long command prints on stderr, or ``None`` under ``-q``; closed when the command
    ends, before :func:`~shardkit.cli.main.main` prints a failure's ``error: ...`` line."""
    if ctx.obj.quiet:
        return None
    progress = Progress(stream=sys.stderr)
    ctx.call_on_close(progress.close)
    return progress


def report_written(result: Any, *, quiet: bool, as_json: bool = False) -> None:
    """What ``reshard``/``convert`` say they wrote (a :class:`~shardkit.checkpoint.offline.result.ConvertResult`):
    JSON on stdout with ``--json``, else one line on stderr unless ``-q`` -- the engine's and the byte
    passthrough's alike."""
    if as_json:
        echo_json(result.__dict__)
        return
    if not quiet:
        click.echo(f"wrote {result.dst_format} checkpoint {result.dst}: {human_count(result.tensors, 'tensor')}, "
                   f"{human_bytes(result.bytes)} of tensor data, {human_bytes(result.stored_bytes)} stored"
                   + (f" ({human_bytes(result.skipped_bytes)} of tensor data already there, kept)"
                      if result.skipped_bytes else ""), err=True)
        if result.dropped:
            click.echo(f"left out {human_count(len(result.dropped), 'key')} (filters/format), e.g. {result.dropped[0]}",
                       err=True)


def storage_options(pairs: Sequence[str]) -> dict[str, Any] | None:
    """``KEY=VALUE`` / ``KEY:=JSON`` pairs → fsspec storage options.

    ``KEY=VALUE`` keeps VALUE a string, always: a secret or a bucket name made
    of digits must not turn into a number.  ``KEY:=JSON`` parses the value as
    JSON for typed options (``anon:=true``, ``default_block_size:=8388608``).
    Dotted keys nest, so ``client_kwargs.endpoint_url=http://127.0.0.1:9000`` works.
    """
    if not pairs:
        return None
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise click.BadParameter(f"{pair!r}: write KEY=VALUE (a string) or KEY:=JSON (typed)",
                                     param_hint="--storage-option")
        key, raw = pair.split("=", 1)
        value: Any = raw
        if key.endswith(":"):
            key = key[:-1]
            try:
                value = json.loads(raw)
            except ValueError:
                raise click.BadParameter(f"{pair!r}: the value after := must be JSON (true, 8388608, "
                                         '"text", {...})', param_hint="--storage-option") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise click.BadParameter(f"{pair!r}: {part} is not an object", param_hint="--storage-option")
        node[parts[-1]] = value
    return out
