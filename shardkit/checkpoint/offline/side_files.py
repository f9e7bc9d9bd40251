"""Side files: what travels with the weights (config.json, tokenizer files) when a checkpoint is converted.

An HF folder has them beside its shards; a native checkpoint made from one
keeps them under ``extra/``, so a later export puts them back where
``from_pretrained`` looks.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from shardkit.checkpoint.io.storage import Storage

__all__ = ["side_files_of", "side_files_meanwhile", "copy_side_files", "copy_files", "SIDE_FILE_BLOCK"]

SIDE_FILE_BLOCK = 8 << 20


def side_files_of(source: Any) -> tuple[Storage | None, list[str]]:
    """Files that travel with the weights (config.json, tokenizer files).

    A reader that carries them names them (``side_files``, relative to its
    ``folder``): an HF folder has them beside the shards; a shardkit checkpoint
    made from one keeps them under ``extra/`` so a later ``convert --to hf``
    can put them back and ``from_pretrained`` finds its config.
    """
    names = getattr(source, "side_files", None)
    if names:
        return source.folder, list(names)
    return None, []


def side_files_meanwhile(source: Any) -> Callable[[], tuple[Storage | None, list[str]]]:
    """:func:`side_files_of`, asked now on a thread when the source is on an object store (finding none
    there is a few requests in a row: the folder, its parent, the bucket), so that a conversion's last
    steps before its commit do not wait for them; the call returned gives the answer or raises its error.
    Elsewhere it is asked when the call is made."""
    storage = getattr(source, "storage", None)
    if not getattr(storage, "is_object_store", False):
        return lambda: side_files_of(source)
    pool = ThreadPoolExecutor(1, thread_name_prefix="shardkit-side-files")
    found = pool.submit(side_files_of, source)
    pool.shutdown(wait=False)
    return found.result


def copy_side_files(source: Any, dst: Storage, into: str = "", *, fsync: bool = False,
                    found: tuple[Storage | None, list[str]] | None = None) -> list[str]:
    """Copy the source's side files to ``dst`` (under ``into``, e.g. ``extra/``); ``found``: what
    :func:`side_files_of` answered already.

    Copied in 8 MiB ranged reads, so a large file that happens to sit beside
    the weights never has to fit the memory budget.
    """
    folder, names = found if found is not None else side_files_of(source)
    return copy_files([(folder, name, f"{into}{name.rsplit('/', 1)[-1]}") for name in names], dst, fsync=fsync)


def copy_files(files: list[tuple[Storage, str, str]], dst: Storage, *, fsync: bool = False) -> list[str]:
    """Copy each ``(folder, name, target)``: ``folder``'s file ``name`` to ``dst``'s ``target``, 8 MiB at a time."""
    written = []
    for folder, name, target in files:
        size = folder.size(name)

        def produce(f: Any, folder: Storage = folder, name: str = name, size: int = size) -> None:
            for start in range(0, size, SIDE_FILE_BLOCK):
                f.write(folder.read_bytes(name, start, min(size, start + SIDE_FILE_BLOCK)))

        dst.write_stream(target, produce, fsync=fsync)
        written.append(target)
    return written
