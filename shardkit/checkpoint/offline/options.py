"""What every offline command shares: the result record, size options, defaults, side files.

A leaf module on purpose: :mod:`offline` (the public calls), :mod:`offline_native`
(the native writer) and :mod:`offline_diff` all need these names, and keeping
them here lets each import the others at module level without a cycle.  The
CLI takes its option defaults from here too, so ``--help`` and the library
cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.formats.native.handler import NATIVE
from shardkit.checkpoint.formats.native.ownership import EXTRA_DIR
from shardkit.errors import ConfigurationError

if TYPE_CHECKING:  # the CLI imports its defaults from here: keep torch out of ``--help``
    from shardkit.checkpoint.io.storage import Storage

__all__ = ["ConvertResult", "parse_size", "parse_memory", "DEFAULT_MAX_MEMORY", "DEFAULT_MAX_MEMORY_TEXT",
           "DEFAULT_WORKERS", "DEFAULT_MAX_SHARD_SIZE", "MIN_MEMORY", "EXTRA_DIR", "side_files_of",
           "copy_side_files", "copy_files"]

DEFAULT_MAX_MEMORY_TEXT = "256MiB"
DEFAULT_MAX_MEMORY = 256 * 2 ** 20
DEFAULT_WORKERS = 4
DEFAULT_MAX_SHARD_SIZE = "5GB"
MIN_MEMORY = 16 * 2 ** 20
SIDE_FILE_BLOCK = 8 << 20

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


@dataclass
class ConvertResult:
    """What a conversion wrote: formats, DST, counts, the files written, and the keys filters left out.

    Two sizes, never to be mixed up: ``bytes`` is the tensor data (what the
    tensors take in memory, after any dtype cast), ``stored_bytes`` what their
    chunks take in the files (smaller with zstd; ``verify`` reads and checks
    exactly these).  ``skipped_bytes`` counts tensor data kept from an
    interrupted earlier run (native output resumes).
    """

    src_format: str
    dst_format: str
    dst: str
    tensors: int
    bytes: int
    files: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    skipped_bytes: int = 0
    stored_bytes: int = 0


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


def side_files_of(source: Any) -> "tuple[Storage | None, list[str]]":
    """Files that travel with the weights (config.json, tokenizer files).

    An HF folder has them beside the shards; a shardkit checkpoint made from
    one keeps them under ``extra/`` so a later ``convert --to hf`` can put them
    back and ``from_pretrained`` finds its config.
    """
    names = getattr(source, "side_files", None)
    if names:
        return source.folder, list(names)
    storage = getattr(source, "storage", None)
    if getattr(source, "info", None) is not None and source.info.format == NATIVE.name and storage is not None:
        names = storage.listdir(EXTRA_DIR)
        if names:
            return storage, [f"{EXTRA_DIR}/{n}" for n in names]
    return None, []


def copy_side_files(source: Any, dst: "Storage", into: str = "", *, fsync: bool = False) -> list[str]:
    """Copy the source's side files to ``dst`` (under ``into``, e.g. ``extra/``).

    Copied in 8 MiB ranged reads, so a large file that happens to sit beside
    the weights never has to fit the memory budget.
    """
    folder, names = side_files_of(source)
    return copy_files([(folder, name, f"{into}{name.rsplit('/', 1)[-1]}") for name in names], dst, fsync=fsync)


def copy_files(files: "list[tuple[Storage, str, str]]", dst: "Storage", *, fsync: bool = False) -> list[str]:
    """Copy each ``(folder, name, target)``: ``folder``'s file ``name`` to ``dst``'s ``target``, 8 MiB at a time."""
    written = []
    for folder, name, target in files:
        size = folder.size(name)

        def produce(f: Any, folder: "Storage" = folder, name: str = name, size: int = size) -> None:
            for start in range(0, size, SIDE_FILE_BLOCK):
                f.write(folder.read_bytes(name, start, min(size, start + SIDE_FILE_BLOCK)))

        dst.write_stream(target, produce, fsync=fsync)
        written.append(target)
    return written
