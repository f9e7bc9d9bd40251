"""``shardkit reshard``/``convert --to shardkit`` of a native checkpoint, run before the engine is imported.

:func:`~shardkit.cli.main.main` asks :func:`run_passthrough` first: a command
line of the few words a byte passthrough takes (SRC, DST, ``--world-size N``
or ``--to shardkit``, the storage options, ``--retries``/``--timeout``,
``--max-memory``, ``--workers``, ``--overwrite``) is run by
:func:`shardkit.checkpoint.offline.passthrough.passthrough` without importing
torch, and reported as the command reports it.  Any other word (a filter, a
cast, ``--json``, ``--help``), a value this does not parse, a launch under
torchrun, or a source the passthrough does not take, and the command is left to
click and the engine, which parse, run and report it as always.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import click

__all__ = ["CommandWords", "command_words", "converted", "passthrough_request", "resume_journal", "run_passthrough",
           "GLOBAL_FLAGS", "REFUSED", "WORLD_SIZES", "WORKERS", "RETRIES", "TIMEOUTS"]

GLOBAL_FLAGS = ("--debug", "-q", "--quiet", "-v", "--verbose")
CONVERSIONS = ("reshard", "convert")
VALUE_OPTIONS = frozenset({
    "--world-size", "--mesh", "--dtype", "--compression", "--to", "--from", "--max-shard-size", "--config",
    "--storage-option", "--dst-storage-option", "--retries", "--timeout", "--max-memory", "--workers", "--only",
    "--exclude", "--rename", "--model-keys"})
FLAG_OPTIONS = frozenset({"--dtype-optim", "--overwrite", "--model-only", "--json", "--distributed",
                          "--single-process", "--trust-pickle"})
# what a passthrough takes; every other option changes the bytes or the output, and goes to the engine
PASSTHROUGH_VALUES = frozenset({"--world-size", "--to", "--storage-option", "--dst-storage-option", "--retries",
                                "--timeout", "--max-memory", "--workers"})
PASSTHROUGH_FLAGS = frozenset({"--overwrite", "--single-process"})
# the values the commands accept: their click options' types (cli/conversion.py, inspection.py and options.py
# use these), so that a value the command refuses goes to click, which reports it in its own words and exit code
WORLD_SIZES = click.IntRange(1, 1 << 20)
WORKERS = click.IntRange(1, 256)
RETRIES = click.IntRange(0, 100)
TIMEOUTS = click.FloatRange(0, min_open=True)


@dataclass
class CommandWords:
    """A ``reshard``/``convert`` command line as words: its positionals, each value option's values in
    order, and its flags (global flags left out)."""

    command: str
    positional: list[str] = field(default_factory=list)
    values: dict[str, list[str]] = field(default_factory=dict)
    flags: set[str] = field(default_factory=set)

    def last(self, name: str) -> str | None:
        """The value of option ``name`` the command takes (the last one given), or ``None``."""
        values = self.values.get(name, [])
        return values[-1] if values else None

    def storage_pairs(self, name: str = "--storage-option") -> list[str]:
        """The ``KEY=VALUE`` pairs of ``name``, then ``--retries``/``--timeout`` as the pairs they stand for,
        in that order -- as the commands append them (``shardkit.cli.options``)."""
        shorthands = [(key, self.last(f"--{key}")) for key in ("retries", "timeout")]
        return self.values.get(name, []) + [f"shardkit.{key}:={value}" for key, value in shorthands
                                            if value is not None]


def command_words(args: list[str]) -> CommandWords | None:
    """The words of a ``reshard``/``convert`` command line that one process runs, or ``None`` (another
    command, a launch under torchrun, ``--help``, or a word this does not know: then nothing is guessed)."""
    words = [a for a in args if a not in GLOBAL_FLAGS]
    if not words or words[0] not in CONVERSIONS or os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    out = CommandWords(words[0])
    rest = iter(words[1:])
    for word in rest:
        if word == "--":
            out.positional.extend(rest)
            break
        if not word.startswith("-") or word == "-":
            out.positional.append(word)
            continue
        name, eq, value = word.partition("=")
        if name in FLAG_OPTIONS and not eq:
            out.flags.add(name)
            continue
        if name not in VALUE_OPTIONS:
            return None
        if not eq:
            value = next(rest, None)
            if value is None:
                return None
        out.values.setdefault(name, []).append(value)
    return out


def _native(name: str | None) -> bool:
    """Whether ``--to`` names shardkit's own format, as the command's choice of formats spells it."""
    from shardkit.checkpoint.formats import NATIVE

    return name == NATIVE.name


REFUSED = object()  # converted()'s answer for a value the command's click option refuses


def converted(kind: click.ParamType, value: str | None) -> Any:
    """``value`` as the command's click option converts it (``None`` when not given), or ``REFUSED`` when
    click refuses it -- the same conversion, so that the passthrough takes exactly what the command takes."""
    if value is None:
        return None
    try:
        return kind.convert(value, None, None)
    except click.BadParameter:
        return REFUSED


def passthrough_request(args: list[str]) -> dict[str, Any] | None:
    """The keyword arguments of :func:`~shardkit.checkpoint.offline.passthrough.passthrough` for a command
    line a passthrough may run, or ``None`` (the engine runs it, and reports what is wrong with it)."""
    words = command_words(args)
    if (words is None or len(words.positional) != 2 or set(words.values) - PASSTHROUGH_VALUES
            or words.flags - PASSTHROUGH_FLAGS):
        return None
    world_size, to = words.last("--world-size"), words.last("--to")
    if words.command == "reshard" and (to is not None or world_size is None):
        return None
    if words.command == "convert" and (world_size is not None or not _native(to)):
        return None
    typed = {name: converted(kind, words.last(name)) for name, kind in (
        ("--world-size", WORLD_SIZES), ("--workers", WORKERS), ("--retries", RETRIES), ("--timeout", TIMEOUTS))}
    if any(value is REFUSED for value in typed.values()):
        return None
    from shardkit.checkpoint.offline.options import DEFAULT_MAX_MEMORY_TEXT, DEFAULT_WORKERS
    from shardkit.cli.render import storage_options

    try:  # as the commands' --retries/--timeout do: every URL's options get them (see options.py)
        so = storage_options(words.storage_pairs())
        dso = storage_options(words.storage_pairs("--dst-storage-option")) if "--dst-storage-option" in words.values \
            else so
    except Exception:  # noqa: BLE001 - the command parses these again and reports what is wrong
        return None
    return {"src": words.positional[0], "dst": words.positional[1], "tool": words.command,
            "world_size": typed["--world-size"] or 1, "overwrite": "--overwrite" in words.flags,
            "storage_options": so, "dst_storage_options": dso,
            "max_memory": words.last("--max-memory") or DEFAULT_MAX_MEMORY_TEXT,
            "workers": typed["--workers"] or DEFAULT_WORKERS}


def resume_journal(args: list[str]) -> tuple[str, list[str]] | None:
    """(the URL of DST's resume journal, DST's storage pairs) of a ``reshard``/``convert`` command line, for
    the head start (:func:`shardkit.checkpoint.io.head_start.begin`'s ``journal``): when it lists a record,
    the command is the rerun of an interrupted one, whose finished outputs need none of the source's first
    blocks.  ``None`` when the line names no DST."""
    from shardkit.checkpoint.io.names import RESUME_DIR

    words = command_words(args)
    if words is None or len(words.positional) != 2:
        return None
    pairs = words.storage_pairs("--dst-storage-option" if "--dst-storage-option" in words.values else
                                "--storage-option")
    return f"{words.positional[1].rstrip('/')}/{RESUME_DIR}", pairs


def run_passthrough(args: list[str], settings: Any, guarded: Callable[[Callable[[], int]], int]) -> int | None:
    """Run ``args`` as a byte passthrough when it is one; its exit code, or ``None`` when the engine is to run
    it (nothing was written).  ``guarded(call)`` runs ``call`` as the command would be run: logging set up,
    an error turned into its ``error: ...`` line and exit code."""
    request = passthrough_request(args)
    if request is None:
        return None
    ran: list[bool] = []

    def call() -> int:
        import sys

        from shardkit.checkpoint.offline.passthrough import passthrough
        from shardkit.checkpoint.offline.progress import Progress
        from shardkit.cli.exit_codes import ExitCode
        from shardkit.cli.render import report_written

        settings.resumable = True  # native output: a rerun resumes from the journal at DST
        progress = None if settings.quiet else Progress(stream=sys.stderr)
        try:
            result = passthrough(**request, progress=progress)
        finally:
            if progress is not None:
                progress.close()
        if result is None:
            return ExitCode.OK
        ran.append(True)
        report_written(result, quiet=settings.quiet)
        return ExitCode.OK

    code = guarded(call)
    return code if ran or code != 0 else None
