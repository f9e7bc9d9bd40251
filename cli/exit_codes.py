"""The ``shardkit`` command's exit codes: one table, used by every command and documented in docs/cli.md.

Why one table: scripts and schedulers branch on the code (retry an
interruption, page someone for an internal error, fail the pipeline on a
damaged checkpoint), so a code must mean the same thing whichever command
returned it.
"""

from __future__ import annotations

import enum

__all__ = ["ExitCode"]


class ExitCode(enum.IntEnum):
    """What the process's exit status says (the rows of "Exit codes" in docs/cli.md)."""

    OK = 0            # the command did what it was asked; verify/diff: intact / equal
    CHECKPOINT = 1    # a checkpoint problem: a ShardkitError (missing, damaged, incompatible, refused), verify found
                      # damage, diff found a difference, inspect found data the checkpoint references gone
    USAGE = 2         # the command line is wrong (click's usage errors: an unknown option, a missing argument)
    INTERNAL = 3      # an unexpected exception: a bug in shardkit (rerun with --debug and report it)
    INTERRUPTED = 130  # Ctrl-C (SIGINT), as shells report 128 + SIGINT; reshard/convert --to shardkit resume on rerun
