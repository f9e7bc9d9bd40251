"""The data files a manifest names, checked before any of their bytes is used: there, whole, and headed right.

A load must not write a target from a file that turns out to be missing,
truncated or replaced, so every file a load touches is checked first: its size
against the manifest's, then its safetensors header (:mod:`.headers`) against
the chunks the manifest says it holds.  ``verify`` checks every file the same
way and then reads every chunk's checksum blocks.
"""

from __future__ import annotations

from typing import Collection

from shardkit.checkpoint.formats.native.headers import check_header
from shardkit.checkpoint.formats.native.manifest import Manifest
from shardkit.checkpoint.formats.safetensors import SafetensorsEntry
from shardkit.checkpoint.io.names import split_reference
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CheckpointNotFound, CorruptCheckpoint

__all__ = ["stored_entries", "check_data_file"]


def stored_entries(manifest: Manifest, names: Collection[str]) -> dict[str, list[SafetensorsEntry]]:
    """For each data file of ``names``, the safetensors entries its header must hold: every chunk of the
    manifest stored there (one entry per strip)."""
    found: dict[str, list[SafetensorsEntry]] = {name: [] for name in names}
    for t in manifest.tensors.values():
        for c in t.chunks:
            if c.file in found:
                found[c.file].extend(c.stored_entries(t.dtype))
    return found


def check_data_file(storage: Storage, manifest: Manifest, name: str, expected: Collection[SafetensorsEntry]) -> None:
    """Raise :class:`~shardkit.errors.CorruptCheckpoint` naming data file ``name`` unless it exists with
    exactly the size the manifest records and its header is intact and holds ``expected``."""
    record = manifest.files[name]
    try:
        got = storage.size(name)
    except CheckpointNotFound:
        shared = split_reference(name)
        raise CorruptCheckpoint(f"{storage.where(name)} is missing; " + (
            f"this checkpoint references that file of {shared[0]}, whose data was deleted or moved "
            f"by hand -- restore {shared[0]} or load another checkpoint" if shared else
            "the checkpoint is incomplete -- restore the file or load another checkpoint")) from None
    if got != record.size:
        raise CorruptCheckpoint(f"{storage.where(name)} has {got} bytes, the manifest records {record.size}: "
                                f"the file is truncated or was replaced")
    check_header(storage, name, record.size, record.header, expected)
