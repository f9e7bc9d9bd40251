"""A node-local file read in pieces straight into memory the caller owns, through one descriptor: how the
hot tier's recovery reads its own copy into the target tensors (``training/hot/flat.py``).

Why not :class:`~shardkit.checkpoint.io.storage.Storage`'s ``read_parts``: a recovery reads a copy in 1 MiB
pieces, each checked (crc32c) while it is still in the cache, a few hundred pieces per rank; the storage
layer's per-request work (URL, retries, views of every part) paid for each piece cost tens of milliseconds.
A copy lives in a plain local directory (the hot tier refuses any other URL), written once and never
rewritten, so one ``os.preadv`` per piece is all a read needs.
"""

from __future__ import annotations

import os
from types import TracebackType

from shardkit.errors import CorruptCheckpoint

__all__ = ["PieceReader"]


class PieceReader:
    """The file at ``path`` held open for reads into buffers (``with PieceReader(path) as f: ...``).  Raises
    ``OSError`` as the system does when it cannot be opened."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)

    @property
    def size(self) -> int:
        """The file's size in bytes now."""
        return os.fstat(self._fd).st_size

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` (a writable byte view) with the file's bytes from ``offset``; a short read goes on where
        it stopped.  Raises :class:`~shardkit.errors.CorruptCheckpoint` naming the file when it ends first."""
        done, want = 0, len(view)
        while done < want:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CorruptCheckpoint(f"{self.path} ends at byte {offset + done}; {offset + want} were expected")
            done += got

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> PieceReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
