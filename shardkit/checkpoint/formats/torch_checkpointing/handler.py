"""The torch_checkpointing format's handler: a step folder of Meta's torch_checkpointing, read only (see
:class:`~shardkit.checkpoint.formats.handler.FormatHandler`)."""

from __future__ import annotations

from typing import Any

from shardkit.checkpoint.formats.handler import FormatHandler
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ShardkitError

METADATA_NAME = "metadata.pkl"  # torch_checkpointing's step metadata, written last: its checkpoints' marker

__all__ = ["TorchCheckpointingHandler", "TORCH_CHECKPOINTING"]


class TorchCheckpointingHandler(FormatHandler):
    """``metadata.pkl`` + one torch.save archive per item and rank.  ``verify`` checks every stored chunk
    against the metadata (its rank file holds the tensor, with the shape and dtype the metadata gives that
    rank) and every storage record it reads against its CRC-32."""

    reader_module = "shardkit.checkpoint.formats.torch_checkpointing.reader"
    name = "torch_checkpointing"
    description = "torch_checkpointing step folder (metadata.pkl + <item>_<rank>.pt; read only)"
    aliases = ("torch-checkpointing",)
    markers = (METADATA_NAME,)

    def verify(self, storage: Storage, reader: Any, problems: list[str], *, workers: int,
               progress: Any) -> int | None:
        records: dict[tuple[str, str], int] = {}  # (file, record) -> bytes checked: strided pieces share one
        try:
            entries = reader.tensors()
        except ShardkitError as exc:
            problems.append(str(exc))
            return None
        for entry in entries.values():
            for index in range(len(entry.chunks)):
                try:
                    key, size = reader.check_chunk(entry, index)
                    records[key] = size
                except ShardkitError as exc:
                    problems.append(str(exc))
                    break
        checked = sum(records.values())
        try:
            reader.values()
        except ShardkitError as exc:
            problems.append(str(exc))
        return checked if checked or problems else None


TORCH_CHECKPOINTING = TorchCheckpointingHandler()
