"""The Hugging Face format's handler: what the tools ask of a safetensors file or folder (see
:class:`~shardkit.checkpoint.formats.handler.FormatHandler`)."""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

import torch

from shardkit.checkpoint.formats.handler import FormatHandler
from shardkit.checkpoint.formats.hf import reader, writer
from shardkit.checkpoint.formats.hf.layout import INDEX_NAME, SINGLE_NAME, export_files
from shardkit.checkpoint.io.storage import Storage

__all__ = ["HfHandler", "HF"]


class HfHandler(FormatHandler):
    """``model.safetensors`` or an index and its shards, as ``save_pretrained`` writes them: model weights
    only, with the config and tokenizer files beside; no checksums to verify."""

    reader_module = reader
    writer_module = writer
    name = "hf"
    description = "Hugging Face safetensors file or folder"
    aliases = ("huggingface", "safetensors")
    markers = (INDEX_NAME, SINGLE_NAME)
    writable = True
    model_export = True
    file_patterns = ("*.safetensors", INDEX_NAME)

    def write(self, storage: Storage, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
              values: Mapping[str, Any], fetch: Any, *, block_bytes: int, max_shard_size: int,
              on_bytes: Callable[[int], None], avoid: Collection[str],
              before_commit: Callable[[], None]) -> list[str]:
        return writer.write_hf(storage, tensors, fetch, block_bytes=block_bytes, max_shard_size=max_shard_size,
                               on_bytes=on_bytes, before_index=before_commit, avoid=avoid)

    def files_of(self, storage: Storage) -> set[str]:
        """The weight files ``from_pretrained`` loads (:func:`~shardkit.checkpoint.formats.hf.layout.export_files`)."""
        return export_files(storage)[0]

    def leftovers(self, storage: Storage) -> set[str]:
        return export_files(storage)[1]

    def foreign(self, storage: Storage, checkpoint_patterns: Collection[str]) -> list[str]:
        """Besides checkpoint-shaped names, the side files beside weights this writer left are not foreign: it
        writes its weights first, then copies config and tokenizer files, then commits, so side files next to
        its weights are a killed export's; without them, they are someone's own."""
        side = set(reader.side_files_in(storage)[0]) if export_files(storage)[1] else set()
        return [n for n in super().foreign(storage, checkpoint_patterns) if n not in side]


HF = HfHandler()
