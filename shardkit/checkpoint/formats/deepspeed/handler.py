"""The DeepSpeed format's handler: a ZeRO checkpoint, read only (see
:class:`~shardkit.checkpoint.formats.handler.FormatHandler`)."""

from __future__ import annotations

from typing import Any

from shardkit.checkpoint.formats.handler import FormatHandler
from shardkit.checkpoint.formats.torchsave.handler import verify_archives
from shardkit.checkpoint.io.storage import Storage

__all__ = ["DeepSpeedHandler", "DEEPSPEED"]


class DeepSpeedHandler(FormatHandler):
    """``latest`` + ``global_stepN/*_states.pt``: every model- and optimizer-state file is a torch.save
    archive whose records carry a CRC-32 (the partitions are checked against ``param_shapes`` on open)."""

    reader_module = "shardkit.checkpoint.formats.deepspeed.reader"
    name = "deepspeed"
    description = "DeepSpeed ZeRO checkpoint (latest + global_stepN/*_states.pt; read only)"
    aliases = ("ds", "zero")
    markers = ("latest",)

    def verify(self, storage: Storage, reader: Any, problems: list[str], *, workers: int,
               progress: Any) -> int | None:
        return verify_archives(reader.archives(), problems)


DEEPSPEED = DeepSpeedHandler()
