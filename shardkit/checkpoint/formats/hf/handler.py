"""The Hugging Face format's handler: what the tools ask of a safetensors file or folder (see
:class:`~shardkit.checkpoint.formats.handler.FormatHandler`)."""

from __future__ import annotations

from typing import Collection

from shardkit.checkpoint.formats.handler import FormatHandler
from shardkit.checkpoint.formats.hf.layout import INDEX_NAME, SINGLE_NAME, export_files
from shardkit.checkpoint.formats.write_job import WriteJob
from shardkit.checkpoint.io.storage import Storage

__all__ = ["HfHandler", "HF"]


class HfHandler(FormatHandler):
    """``model.safetensors`` or an index and its shards, as ``save_pretrained`` writes them: model weights
    only, with the config and tokenizer files beside; no checksums to verify."""

    reader_module = "shardkit.checkpoint.formats.hf.reader"
    writer_module = "shardkit.checkpoint.formats.hf.writer"
    name = "hf"
    description = "Hugging Face safetensors file or folder"
    aliases = ("huggingface", "safetensors")
    markers = (INDEX_NAME, SINGLE_NAME)
    writable = True
    model_export = True
    write_options = ("config",)  # its config and tokenizer files beside the weights
    file_patterns = ("*.safetensors", INDEX_NAME)

    def write_files(self, storage: Storage, job: WriteJob) -> list[str]:
        return self.writer.write_hf(storage, list(job.tensors), job.fetch, block_bytes=job.block_bytes,
                                    max_shard_size=job.max_shard_size, on_bytes=job.on_bytes,
                                    before_index=job.before_commit, avoid=job.avoid)

    def files_of(self, storage: Storage) -> set[str]:
        """The weight files ``from_pretrained`` loads (:func:`~shardkit.checkpoint.formats.hf.layout.export_files`)."""
        return export_files(storage)[0]

    def leftovers(self, storage: Storage) -> set[str]:
        return export_files(storage)[1]

    def foreign(self, storage: Storage, checkpoint_patterns: Collection[str]) -> list[str]:
        """Besides checkpoint-shaped names, the side files beside weights this writer left are not foreign: it
        writes its weights first, then copies config and tokenizer files, then commits, so side files next to
        its weights are a killed export's; without them, they are someone's own."""
        side = set(self.reader.side_files_in(storage)[0]) if export_files(storage)[1] else set()
        return [n for n in super().foreign(storage, checkpoint_patterns) if n not in side]


HF = HfHandler()
