"""The DCP format's handler: what the tools ask of a ``torch.distributed.checkpoint`` directory (see
:class:`~shardkit.checkpoint.formats.handler.FormatHandler`)."""

from __future__ import annotations

from typing import Any

from shardkit.checkpoint.formats.handler import FormatHandler
from shardkit.checkpoint.formats.write_job import WriteJob
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ShardkitError

METADATA_NAME = ".metadata"  # a DCP checkpoint's metadata, written last: its marker

__all__ = ["DcpHandler", "DCP", "verify_payloads", "verify_values"]


class DcpHandler(FormatHandler):
    """``.metadata`` + ``*.distcp`` payloads, each a torch.save archive whose records carry a CRC-32."""

    reader_module = "shardkit.checkpoint.formats.dcp.reader"
    writer_module = "shardkit.checkpoint.formats.dcp.writer"
    name = "dcp"
    description = "torch.distributed.checkpoint directory"
    markers = (METADATA_NAME,)
    writable = True
    file_patterns = ("*.distcp", METADATA_NAME)
    verify_shows_progress = True

    def write_files(self, storage: Storage, job: WriteJob) -> list[str]:
        job.before_commit()
        return self.writer.write_dcp(storage, list(job.tensors), job.values, job.fetch,
                                     block_bytes=job.block_bytes, on_bytes=job.on_bytes, avoid=job.avoid)

    def files_of(self, storage: Storage) -> set[str]:
        return {METADATA_NAME} | {n for n in storage.listdir() if n.endswith(".distcp")}

    def verify(self, storage: Storage, reader: Any, problems: list[str], *, workers: int,
               progress: Any) -> int | None:
        checked = verify_payloads(reader, problems, progress)
        verify_values(reader, problems)
        return checked


def verify_payloads(reader: Any, problems: list[str], progress: Any) -> int:
    """Stream every chunk's payload record of DCP ``reader`` through its CRC-32 (or decode it where it has
    none); append what is wrong to ``problems``; return the bytes checked."""
    entries = reader.tensors()
    if progress:
        progress.start("verify", sum(c.locator.length for e in entries.values() for c in e.chunks))
    nbytes = 0
    for entry in entries.values():
        for i in range(len(entry.chunks)):
            try:
                n = reader.check_chunk(entry, i)
                nbytes += n
                if progress:
                    progress.update(n)
            except ShardkitError as exc:
                problems.append(str(exc))
    return nbytes


def verify_values(reader: Any, problems: list[str]) -> None:
    """Decode every value of DCP ``reader`` (its payload's CRC-32s checked first); append what is damaged
    to ``problems``.  A value shardkit leaves out unread (pickle bytes: torchtitan's data loader
    position) is intact as far as its checksums go, so it is no problem here."""
    values = reader.values()
    for key in values:
        try:
            values.refusal(key)
        except ShardkitError as exc:
            problems.append(str(exc))


DCP = DcpHandler()
