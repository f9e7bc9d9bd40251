"""The ``shardkit`` subcommands, as the group registers them: reshard, convert, inspect, verify, diff.

Each one parses its options, calls the library function of the same name
(``reshard`` and ``convert`` through :mod:`shardkit.checkpoint.offline.scaleout`,
which splits them across processes under torchrun; ``inspect``, ``verify`` and
``diff`` as :mod:`shardkit.checkpoint.offline.convert` exports them), and renders
the result.  Exit code 0 means
success; 1 means the command found a problem (verify: damage, diff: a
difference) or failed with a one-line error.

Why a module of its own: :mod:`shardkit.cli.main` loads it only once the head start is on its way
(``_register``), since the commands' imports (the format registry, torch with it) take a while; this is the
one list it registers.  The commands that write live in :mod:`shardkit.cli.conversion`, those that only
read in :mod:`shardkit.cli.inspection`, and the options they share in :mod:`shardkit.cli.options`.
"""

from __future__ import annotations

from shardkit.checkpoint.formats import FORMATS
from shardkit.cli.conversion import convert, reshard
from shardkit.cli.inspection import diff, inspect, verify


def formats_help() -> str:
    """The help's list of formats, one line each, from the format registry (so a new format shows up)."""
    width = max(len(name) for name in FORMATS)
    lines = [f"  {name.ljust(width)}  {fmt.description}" for name, fmt in FORMATS.items()]
    return "\b\nFormats (detected; --from and --to name them):\n" + "\n".join(lines)


COMMANDS = [reshard, convert, inspect, verify, diff]
