"""The native format's handler: what the tools ask of a shardkit checkpoint (see
:class:`~shardkit.checkpoint.formats.handler.FormatHandler`)."""

from __future__ import annotations

import hashlib
from typing import Any

from shardkit.checkpoint.formats.handler import FormatHandler
from shardkit.checkpoint.formats.native.manifest import FORMAT_NAME, MANIFEST_NAME
from shardkit.checkpoint.formats.native.ownership import DATA_DIR, EXTRA_DIR, survey
from shardkit.checkpoint.formats.native.resumable import write_resumable
from shardkit.checkpoint.formats.native.verify_data import verify_data_files
from shardkit.checkpoint.formats.write_job import WriteJob, Written
from shardkit.checkpoint.io.storage import Storage

__all__ = ["NativeHandler", "NATIVE"]


class NativeHandler(FormatHandler):
    """manifest.json + safetensors data files: resumable, laid out for ranks, every chunk checksummed.

    Its :meth:`write` is the parallel, resumable writer for N ranks
    (:mod:`~shardkit.checkpoint.formats.native.resumable`).
    """

    reader_module = "shardkit.checkpoint.formats.native.reader"
    writer_module = "shardkit.checkpoint.formats.native.writer"
    name = FORMAT_NAME
    description = "native: manifest.json + safetensors chunks"
    aliases = ("native",)
    markers = (MANIFEST_NAME,)
    open_options = ("io_threads",)
    writable = True
    write_options = ("world_size", "mesh", "compression")  # output laid out for ranks, optionally compressed
    content_pin = MANIFEST_NAME  # it holds every chunk's crc32c
    file_patterns = (MANIFEST_NAME,)
    data_folders = (DATA_DIR,)
    verify_shows_progress = True

    def write(self, storage: Storage, job: WriteJob) -> Written | None:
        """Data files for ``job.world_size`` ranks, written by ``job.workers`` threads (or split over the
        processes of ``job.scaleout``), each journaled as it lands so a rerun resumes; then the manifest."""
        return write_resumable(storage, job, self.name)

    def resumes(self) -> bool:
        return True

    def files_of(self, storage: Storage) -> set[str]:
        """What :func:`~shardkit.checkpoint.formats.native.ownership.survey` says shardkit wrote, less the side
        files under ``extra/``: the new checkpoint rewrites those in place."""
        return {n for n in survey(storage).owned if not n.startswith(f"{EXTRA_DIR}/")}

    def replacing_id(self, storage: Storage) -> str:
        """A digest of the manifest, so the new checkpoint plans file names the old one does not use."""
        return hashlib.sha256(storage.read_bytes(MANIFEST_NAME)).hexdigest()[:16]

    def foreign(self, storage: Storage, checkpoint_patterns: Any = ()) -> list[str]:
        """What ``survey`` calls foreign: an interrupted run's data files and resume journal are not."""
        return survey(storage).foreign

    def verify(self, storage: Storage, reader: Any, problems: list[str], *, workers: int,
               progress: Any) -> int | None:
        return verify_data_files(reader, problems, workers, progress)


NATIVE = NativeHandler()
