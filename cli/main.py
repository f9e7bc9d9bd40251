"""Entry point of the ``shardkit`` command: the group, global options, and error handling.

The command only parses, calls :mod:`shardkit.checkpoint`, and renders.
Messages and progress go to stderr, data to stdout.  A
:class:`~shardkit.errors.ShardkitError` becomes one line ``error: ...`` and a
non-zero exit; ``--debug`` shows the traceback too, and the library's DEBUG
log (retries, plans); ``--verbose`` its INFO log (one line per file set
written, with bytes and seconds).  The global flags may come before or after
the subcommand (``shardkit inspect X -q``).
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any, Callable

import click

from shardkit import __version__
from shardkit.cli.exit_codes import ExitCode
from shardkit.cli.passthrough import (  # the option lists: what the head start and the passthrough know
    FLAG_OPTIONS,  # noqa: F401 - named here too: the head start's words
    GLOBAL_FLAGS,
    REFUSED,
    VALUE_OPTIONS,  # noqa: F401 - named here too: the head start's words
    WORKERS,
    command_words,
    converted,
    resume_journal,
    run_passthrough,
)

INTERRUPT_GRACE_S = 1.0  # after Ctrl-C, how long the command may take to stop before it leaves regardless
INTERRUPTED = "error: interrupted"
RESUMES = ("error: interrupted; rerunning the same command resumes (the data files already written are "
           "verified and kept)")


class Settings:
    """Global options, handed to every command through click's context object.

    ``resumable`` is set by a command whose rerun resumes what it was doing
    (native output keeps a resume journal at DST), so that an interrupted run
    (Ctrl-C) tells the user to rerun it -- and no other command claims that.
    """

    def __init__(self, debug: bool = False, quiet: bool = False, verbose: bool = False) -> None:
        self.debug = debug
        self.quiet = quiet
        self.verbose = verbose
        self.resumable = False


def hoist_global_flags(args: list[str]) -> list[str]:
    """Move the global flags to the front, wherever the user typed them (up to a ``--``)."""
    end = args.index("--") if "--" in args else len(args)
    flags = [a for a in args[:end] if a in GLOBAL_FLAGS]
    rest = [a for a in args[:end] if a not in GLOBAL_FLAGS]
    return flags + rest + args[end:]


def configure_logging(settings: Settings) -> None:
    """The library logs under ``shardkit``; the command shows warnings (``-q`` too: a warning says
    something is unsafe or was not checked), or more when asked."""
    level = logging.DEBUG if settings.debug else logging.INFO if settings.verbose else logging.WARNING
    reset_logging()
    logger = logging.getLogger("shardkit")
    handler = logging.StreamHandler(sys.stderr)
    handler.shardkit_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.setLevel(level)  # a child logger set lower elsewhere (a test, a notebook) does not leak here
    logger.addHandler(handler)
    logger.setLevel(level)


def reset_logging() -> None:
    """Undo :func:`configure_logging` (the command may run in-process, e.g. from a test or a notebook)."""
    logger = logging.getLogger("shardkit")
    for handler in [h for h in logger.handlers if getattr(h, "shardkit_cli", False)]:
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="shardkit")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors and the debug log (retries, plans).")
@click.option("-v", "--verbose", is_flag=True, help="Log one line per file set written or read (bytes, seconds).")
@click.option("-q", "--quiet", is_flag=True, help="No progress or notes on stderr (errors still print).")
@click.pass_context
def cli(ctx: click.Context, debug: bool, verbose: bool, quiet: bool) -> None:
    """Inspect, verify, compare, reshard and convert checkpoints, on any storage.

    SRC and DST are paths or fsspec URLs (file://, memory://, s3://, gs://, ...).

    \b
    Example:
      shardkit inspect ./ckpt/step-100
      shardkit reshard ./ckpt/step-100 s3://bucket/step-100-ws8 --world-size 8
      shardkit verify s3://bucket/step-100 --debug
    """
    settings = ctx.ensure_object(Settings)  # main() keeps it, to word an interruption
    settings.debug, settings.quiet, settings.verbose = debug, quiet, verbose
    configure_logging(settings)


def _register() -> None:
    from shardkit.cli import commands

    for command in commands.COMMANDS:
        cli.add_command(command)
    # the formats come from the format registry, so the help names every one, before the example
    intro, example, rest = inspect.cleandoc(cli.help or "").partition("\b\nExample:")
    cli.help = f"{intro.rstrip()}\n\n{commands.formats_help()}\n\n{example}{rest}"


_register_done = False


def head_start_request(args: list[str]) -> tuple[str, list[str], str | None, int] | None:
    """(SRC, its ``--storage-option`` pairs, ``--max-memory``, ``--workers``) of a ``reshard``/``convert``
    command line that one process runs, or ``None`` (another command, a help request, scale-out, or a
    word this does not know: then nothing is guessed)."""
    from shardkit.checkpoint.offline.options import DEFAULT_WORKERS

    words = command_words(args)
    if words is None or "--distributed" in words.flags:
        return None
    workers = converted(WORKERS, words.last("--workers"))  # as the command's click type reads it
    if len(words.positional) != 2 or workers is REFUSED:
        return None
    return words.positional[0], words.storage_pairs(), words.last("--max-memory"), workers or DEFAULT_WORKERS


def start_head(args: list[str]) -> bool:
    """For ``reshard``/``convert`` from an object store: start fetching the source's first blocks now,
    while the command imports its engine (:mod:`shardkit.checkpoint.io.head_start`); whether it started.
    Anything this cannot parse is left to the command, which reports it."""
    request = head_start_request(args)
    if request is None:
        return False
    src, pairs, memory, workers = request
    if "://" not in src or src.startswith("file://"):
        return False
    from shardkit.checkpoint.io import head_start
    from shardkit.checkpoint.offline.options import cache_budget, parse_memory
    from shardkit.cli.render import storage_options

    journal, journal_pairs = resume_journal(args) or (None, [])
    try:
        options = storage_options(pairs)
        journal_options = storage_options(journal_pairs)
        budget = cache_budget(parse_memory(memory))
    except Exception:  # noqa: BLE001 - the command parses these again and reports what is wrong
        return False
    # a rerun (DST's resume journal holds a record) guesses no block: see head_start
    return head_start.begin(src, options, budget=budget, threads=max(1, workers), journal=journal,
                            journal_options=journal_options)


class Interrupt:
    """Ctrl-C in the ``shardkit`` process: stop within :data:`INTERRUPT_GRACE_S`, whatever is in flight.

    Why: a signal reaches only the main thread, while the requests of a
    ``reshard`` to an object store run in worker threads (and their retries
    sleep there), and the interpreter's exit would wait for each of them.  So
    the first Ctrl-C stops every storage retry of the process, raises
    ``KeyboardInterrupt`` in the main thread as usual, and starts a timer; the
    process leaves (``os._exit``, buffers flushed, the one-line message
    printed once) as soon as :func:`main` has handled the interrupt, or when
    the timer fires, without joining threads still inside a request.  What a
    rerun resumes is safe: a data file is journaled only once it is whole,
    and an upload left unfinished is never completed under its name.  Only
    the console script installs this; in-process calls (tests, notebooks)
    keep Python's own Ctrl-C.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._once = threading.Lock()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: object) -> None:
        from shardkit.checkpoint.io.retries import interrupt_retries

        interrupt_retries()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the process at once
        timer = threading.Timer(INTERRUPT_GRACE_S, self.leave)
        timer.daemon = True
        timer.start()
        raise KeyboardInterrupt

    def leave(self) -> None:
        """Print the interruption line (once), flush, and end the process with exit code 130."""
        if not self._once.acquire(blocking=False):
            return
        try:
            click.echo(RESUMES if self.settings.resumable else INTERRUPTED, err=True)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(ExitCode.INTERRUPTED)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``shardkit``), also ``python -m shardkit``.

    A ``reshard``/``convert`` from an object store starts fetching its source first (:func:`start_head`),
    so that its first blocks arrive while torch is imported; one a byte passthrough takes (a native SRC
    moved as it is stored: :mod:`shardkit.cli.passthrough`) is run then, and torch is never imported.
    The console script leaves with :func:`leave_now` once the command is done and its output flushed:
    every file it wrote is durable and committed by then, and tearing down the interpreter (torch's
    thousands of modules, the clients' sessions) would add a second or more to every command for nothing.
    In-process calls (tests, notebooks) get ``SystemExit`` as before."""
    global _register_done
    args = hoist_global_flags(sys.argv[1:] if argv is None else list(argv))
    console = argv is None and threading.current_thread() is threading.main_thread()
    started = console and start_head(args)  # before the commands' imports (torch): see start_head
    settings = Settings()
    interrupt = Interrupt(settings) if console else None
    if interrupt is not None:
        interrupt.install()
    try:
        # a native SRC's bytes moved as they are, before click's commands (and torch) are imported
        code = run_passthrough(args, settings, lambda call: guarded(call, args, settings, interrupt,
                                                                      set_up=True))
        if code is None:
            if not _register_done:
                _register()
                _register_done = True
            code = run(args, settings, interrupt)
    except SystemExit as exc:  # a command that ends the process itself
        if interrupt is None:
            raise
        if exc.code is not None and not isinstance(exc.code, int):
            click.echo(str(exc.code), err=True)  # what the interpreter would print for sys.exit("message")
        code = exc.code if isinstance(exc.code, int) else ExitCode.OK if exc.code is None else ExitCode.CHECKPOINT
    finally:
        if started:
            from shardkit.checkpoint.io import head_start

            head_start.drop()
    if interrupt is not None:
        leave_now(code)
    sys.exit(code)


def run(args: list[str], settings: Settings, interrupt: Interrupt | None) -> int:
    """Run the command line ``args``; its exit code (a ``ShardkitError`` becomes one ``error:`` line)."""
    return guarded(lambda: cli.main(args=args, prog_name="shardkit", standalone_mode=False, obj=settings),
                   args, settings, interrupt)


def guarded(call: Callable[[], Any], args: list[str], settings: Settings, interrupt: Interrupt | None, *,
            set_up: bool = False) -> int:
    """Run ``call`` (a command of ``args``) the way every command is run: its outcome as an exit code -- an
    error as one ``error:`` line, an interruption as its own; ``set_up``: apply the global flags here (click's
    group does for its commands; the passthrough runs without it)."""
    debug = "--debug" in args
    try:
        try:
            if set_up:
                settings.debug, settings.quiet = debug, "-q" in args or "--quiet" in args
                settings.verbose = "-v" in args or "--verbose" in args
                configure_logging(settings)
            code = call()
        finally:
            reset_logging()
    except (click.exceptions.Abort, KeyboardInterrupt):  # click turns a Ctrl-C in a command into Abort
        if interrupt is not None:
            interrupt.leave()  # without waiting for worker threads still inside a request
        click.echo(RESUMES if settings.resumable else INTERRUPTED, err=True)
        return ExitCode.INTERRUPTED
    except click.ClickException as exc:
        exc.show()
        return ExitCode.USAGE if isinstance(exc, click.UsageError) else ExitCode.CHECKPOINT
    except Exception as exc:  # noqa: BLE001 - the one place that turns errors into exit codes
        from shardkit.errors import ShardkitError

        if debug:
            traceback.print_exc()
        if isinstance(exc, ShardkitError):
            click.echo(f"error: {_one_line(str(exc))}", err=True)
            return ExitCode.CHECKPOINT
        click.echo(f"internal error: {type(exc).__name__}: {_one_line(str(exc))} (rerun with --debug for the "
                   "traceback)", err=True)
        return ExitCode.INTERNAL
    return ExitCode(code) if isinstance(code, int) else ExitCode.OK


def leave_now(code: int) -> None:
    """End the process with ``code`` once stdout, stderr and the log are flushed, without the interpreter's
    teardown (a pipe closed early, ``shardkit inspect X | head``, is no error)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, or a stream already closed
            pass
    os._exit(int(code))


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(no message)"
