"""The offline commands' options: their defaults and the parsing of sizes.

A leaf module on purpose, free of torch: the CLI takes its option defaults
from here, so ``--help`` and the library cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from shardkit.errors import ConfigurationError

__all__ = ["cache_budget", "parse_mesh", "parse_size", "parse_memory", "DEFAULT_MAX_MEMORY", "DEFAULT_MAX_MEMORY_TEXT",
           "DEFAULT_WORKERS", "DEFAULT_MAX_SHARD_SIZE", "MIN_MEMORY"]

DEFAULT_MAX_MEMORY_TEXT = "256MiB"
DEFAULT_MAX_MEMORY = 256 * 2 ** 20
DEFAULT_WORKERS = 4
DEFAULT_MAX_SHARD_SIZE = "5GB"
MIN_MEMORY = 16 * 2 ** 20

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(value: str | int, option: str = "size") -> int:
    """``"5GB"`` → 5·10⁹, ``"64MiB"`` → 2²⁶, ``1000`` → 1000; the HF spelling of sizes.

    Errors name the ``option`` the value came from, so a user sees which flag to fix.
    """
    if isinstance(value, bool):
        raise ConfigurationError(f"{option} {value!r}: write a size such as 5GB, 500MB or 64MiB")
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip().upper().replace(" ", "")
        number = text.rstrip("KMGTIB")
        unit = text[len(number):]
        try:
            if unit not in _UNITS or not number:
                raise ValueError(text)
            n = int(float(number) * _UNITS[unit])
        except (ValueError, OverflowError):
            raise ConfigurationError(f"{option} {value!r}: write a size such as 5GB, 500MB or 64MiB") from None
    if n <= 0:
        raise ConfigurationError(f"{option} {value!r}: a size must be positive")
    return n


def parse_memory(value: int | str | None) -> int:
    """The ``--max-memory`` budget in bytes (default 256 MiB).

    Below 16 MiB the per-chunk overheads (headers, checksum blocks, thread
    buffers) would dominate, so smaller budgets are refused rather than silently
    exceeded.
    """
    if value is None:
        return DEFAULT_MAX_MEMORY
    n = parse_size(value, "--max-memory")
    if n < MIN_MEMORY:
        raise ConfigurationError(f"--max-memory {value!r} is below the 16 MiB minimum")
    return n


def cache_budget(budget: int) -> int:
    """The block cache's share of a conversion's memory ``budget``: a quarter (64 MiB, eight 8 MiB
    blocks, at the default 256 MiB; below 64 MiB the blocks shrink to half the share, so that a small
    budget is kept, at the price of smaller requests)."""
    return budget // 4


def parse_mesh(value: Any) -> tuple[int, ...]:
    """``"2x4"``, ``(2, 4)`` or ``8`` → a mesh shape of one or two positive sizes."""
    try:
        if isinstance(value, str):
            dims = tuple(int(x) for x in value.lower().split("x"))
        elif isinstance(value, int):
            dims = (value,)
        else:
            dims = tuple(int(x) for x in value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"--mesh {value!r}: write e.g. 8 or 2x4 (replicas x shards)") from None
    if not 1 <= len(dims) <= 2 or min(dims) < 1:
        raise ConfigurationError(f"--mesh {value!r}: one or two positive sizes, e.g. 8 or 2x4")
    return dims
