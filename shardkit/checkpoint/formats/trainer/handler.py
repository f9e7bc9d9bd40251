"""The Trainer/Accelerate format's handler: a training run's checkpoint folder, read only (see
:class:`~shardkit.checkpoint.formats.handler.FormatHandler`)."""

from __future__ import annotations

from typing import Any

from shardkit.checkpoint.formats.dcp.handler import verify_payloads
from shardkit.checkpoint.formats.handler import FormatHandler
from shardkit.checkpoint.formats.native import NATIVE
from shardkit.checkpoint.formats.torchsave.handler import verify_archives
from shardkit.checkpoint.io.storage import Storage

__all__ = ["TrainerHandler", "TRAINER"]


class TrainerHandler(FormatHandler):
    """``checkpoint-N/``: model, optimizer, RNG and scheduler parts, each verified as its own format is
    (torch.save files by their CRC-32s, sharded DCP parts by theirs, shardkit parts by their crc32c
    blocks); safetensors weights by headers."""

    reader_module = "shardkit.checkpoint.formats.trainer.reader"
    name = "trainer"
    description = "Hugging Face Trainer / Accelerate checkpoint folder (model, optimizer, RNG; read only)"
    aliases = ("accelerate", "hf-trainer")
    open_options = ("torch_options",)

    def verify(self, storage: Storage, reader: Any, problems: list[str], *, workers: int,
               progress: Any) -> int | None:
        checked = verify_archives(reader.archives(), problems) or 0
        for part in reader.dcp_parts():  # a Trainer's sharded model and optimizer
            checked += verify_payloads(part, problems, None)
        for part in reader.native_parts():  # the same folders written by use_shardkit(): every crc32c block
            checked += NATIVE.verify(part.storage, part, problems, workers=workers, progress=None) or 0
        return checked if checked or problems else None


TRAINER = TrainerHandler()
