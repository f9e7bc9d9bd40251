"""The torch.save format's handler: what the tools ask of one ``torch.save`` file (see
:class:`~shardkit.checkpoint.formats.handler.FormatHandler`)."""

from __future__ import annotations

from typing import Any

from shardkit.checkpoint.formats.handler import FormatHandler
from shardkit.checkpoint.formats.write_job import WriteJob
from shardkit.checkpoint.io.storage import Storage, split_file
from shardkit.errors import ShardkitError

__all__ = ["TorchSaveHandler", "TORCH", "verify_archive", "verify_archives"]


class TorchSaveHandler(FormatHandler):
    """One zip archive read through the ``weights_only`` allowlist; the file is its own commit marker (the
    writer renames the finished file over the old one), and every record carries a CRC-32."""

    reader_module = "shardkit.checkpoint.formats.torchsave.reader"
    writer_module = "shardkit.checkpoint.formats.torchsave.writer"
    name = "torch"
    description = "torch.save file (weights_only)"
    aliases = ("pt", "torch.save")
    open_options = ("torch_options",)
    writable = True
    single_file = True

    def write_files(self, storage: Storage, job: WriteJob) -> list[str]:
        parent, name = split_file(storage)
        job.before_commit()
        self.writer.write_torch_save(parent, name, list(job.tensors), job.values, job.fetch,
                                     block_bytes=job.block_bytes, on_bytes=job.on_bytes)
        return [name]

    def files_of(self, storage: Storage) -> set[str]:
        """The file itself, by its name in its folder (replaced by the rename that commits the new one)."""
        return {split_file(storage)[1]} if storage.exists() else set()

    def verify(self, storage: Storage, reader: Any, problems: list[str], *, workers: int,
               progress: Any) -> int | None:
        return verify_archives([split_file(storage)], problems)


def verify_archive(folder: Storage, name: str, problems: list[str]) -> int:
    """Stream every record of zip archive ``name`` in ``folder`` through its CRC-32; return the bytes checked."""
    try:
        from shardkit.checkpoint.formats.torchsave.zip_records import check_zip_records

        return check_zip_records(folder, name, 0, folder.size(name), folder.where(name))
    except ShardkitError as exc:
        problems.append(str(exc))
        return 0


def verify_archives(files: list[tuple[Storage, str]], problems: list[str]) -> int | None:
    """:func:`verify_archive` of each ``(folder, name)``; ``None`` when all were written without CRC-32s (every
    one 0) and nothing is wrong: there was nothing to check the data against."""
    checked = sum(verify_archive(folder, name, problems) for folder, name in files)
    return checked if checked or problems else None


TORCH = TorchSaveHandler()
