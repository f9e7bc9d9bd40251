"""``verify`` of a native checkpoint: every data file's size and header, and every chunk's crc32c blocks.

Files are read front to back in large ranged reads, several files in
parallel, so this runs at disk speed; a damaged header is one problem and the
chunks behind it are still checked by their checksums.
"""

from __future__ import annotations

from typing import Any

from shardkit.checkpoint.formats.native.checksums import check_chunk
from shardkit.checkpoint.formats.native.headers import check_header
from shardkit.checkpoint.io.concurrency import parallel_map
from shardkit.checkpoint.io.names import split_reference
from shardkit.errors import ShardkitError

__all__ = ["verify_data_files"]


def verify_data_files(reader: Any, problems: list[str], workers: int, progress: Any) -> int:
    """Check every data file the manifest of ``reader`` names; append what is wrong to ``problems``; return the
    stored bytes checked (``progress``, when given, is told of them as they are read)."""
    storage, manifest = reader.storage, reader.manifest
    by_file: dict[str, list[tuple[str, Any]]] = {name: [] for name in manifest.files}
    for fqn, t in manifest.tensors.items():
        for rec in t.chunks:
            by_file.setdefault(rec.file, []).append((fqn, rec))
    if progress:
        progress.start("verify", sum(rec.nbytes for t in manifest.tensors.values() for rec in t.chunks))

    def check(name: str) -> tuple[list[str], int]:
        found: list[str] = []
        where = storage.where(name)
        try:
            size = storage.size(name)
        except ShardkitError:
            shared = split_reference(name)
            return [f"{where}: missing" + (f"; this checkpoint references that file of {shared[0]}, whose data was "
                                           f"deleted or moved by hand" if shared else "")], 0
        want = manifest.files[name].size if name in manifest.files else None
        if want is not None and size != want:
            return [f"{where}: {size} bytes, the manifest records {want} (truncated or replaced)"], 0
        if want is not None:  # a damaged header is one problem; the chunks are still checked by their checksums
            try:
                check_header(storage, name, want, manifest.files[name].header,
                             [e for fqn, rec in by_file[name] for e in rec.stored_entries(manifest.tensors[fqn].dtype)])
            except ShardkitError as exc:
                found.append(str(exc))
        done = 0

        def count(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress.update(n)

        for fqn, rec in sorted(by_file[name], key=lambda x: x[1].start):
            bad = check_chunk(storage, rec, on_bytes=count)
            if bad is not None:
                found.append(f"{where}: chunk {list(rec.offsets)} of {fqn!r} fails its checksum (block {bad})")
        return found, done

    total = 0
    for found, done in parallel_map(check, sorted(by_file), max(1, workers)):
        problems.extend(found)
        total += done
    return total
