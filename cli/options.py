"""The options more than one ``shardkit`` command takes, declared once so each command reads them alike.

Every command takes ``--storage-option`` (worded for the URLs that command has) with its shorthands
``--retries`` and ``--timeout``; ``inspect`` and the conversions both take ``--trust-pickle``.  Declaring them
here keeps one help text and one meaning per flag, whichever command a user types it after.
"""

from __future__ import annotations

import functools
from typing import Any

import click

from shardkit.cli.passthrough import RETRIES, TIMEOUTS  # the types the byte passthrough reads them by

__all__ = ["STORAGE_OPTION_HELP", "COMMON_STORAGE", "storage_flags", "trust_pickle_option"]

# what --storage-option applies to, per command: only the locations that command has
STORAGE_OPTION_HELP = {
    "src": "fsspec option for SRC; repeatable.",
    "src_dst": "fsspec option for SRC (and DST unless --dst-storage-option); repeatable.",
    "a_b": "fsspec option for A (and B unless --b-storage-option); repeatable.",
}

COMMON_STORAGE = [
    click.option("--retries", type=RETRIES, metavar="N",
                 help="Retries of a failed storage request [default: 3; 0 on gs:// and az://, whose SDKs retry]. "
                      "Same as --storage-option shardkit.retries:=N, for every URL."),
    click.option("--timeout", type=TIMEOUTS, metavar="SECONDS",
                 help="Seconds a storage request may wait for an answer [default: 8]. Same as "
                      "--storage-option shardkit.timeout:=SECONDS, for every URL."),
]


def storage_flags(locations: str):
    """``--storage-option``, ``--retries`` and ``--timeout``; ``locations`` (a key of
    :data:`STORAGE_OPTION_HELP`) says which of the command's URLs ``--storage-option`` reaches."""
    def decorate(fn):
        return _with_storage(fn, STORAGE_OPTION_HELP[locations])
    return decorate


def _with_storage(fn, storage_option_help: str):
    @functools.wraps(fn)
    def with_retries_and_timeout(*args: Any, retries: int | None, timeout: float | None, **kwargs: Any) -> Any:
        # --retries/--timeout are shorthands: append them to every URL's storage options (an empty
        # --dst-storage-option / --b-storage-option list means "as SRC" and inherits them from there)
        extra = tuple(f"shardkit.{k}:={v}" for k, v in (("retries", retries), ("timeout", timeout)) if v is not None)
        for name in ("storage_opts", "dst_opts", "b_opts"):
            if name in kwargs and (name == "storage_opts" or kwargs[name]):
                kwargs[name] = tuple(kwargs[name]) + extra
        return fn(*args, **kwargs)

    for deco in reversed(COMMON_STORAGE):
        with_retries_and_timeout = deco(with_retries_and_timeout)
    return click.option("--storage-option", "storage_opts", multiple=True, metavar="KEY=VALUE",
                        help=storage_option_help)(with_retries_and_timeout)


# --trust-pickle: inspect reads a torch.save SRC with it, reshard and convert convert one
trust_pickle_option = click.option(
    "--trust-pickle", is_flag=True,
    help="torch.save SRC: unpickle classes outside torch.load's weights_only allowlist. UNSAFE: runs any code the "
         "file names; only for files you trust.")

