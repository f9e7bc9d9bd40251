"""Hugging Face safetensors checkpoints read safely: one ``model.safetensors`` or shards + index.

Reading parses each file's safetensors header with a ranged read and checks it
strictly (header length cap, JSON shape, dtypes, offsets inside the file, no
overlaps or holes) before any tensor byte is trusted; tensors are then read a
block of rows at a time with ranged reads, never the whole file.  Writing is
:mod:`.writer`'s.

Names: an HF key ``k`` is the model tensor ``model.k`` in shardkit's
flattened naming.

Which weights a folder holds: ``model.safetensors`` when it is there, even
beside an index, else the index and the shards it names
(:func:`~shardkit.checkpoint.formats.hf.layout.weights_file`) -- the order
``from_pretrained`` looks in, so shardkit and transformers always load the
same weights; the writer's commit points follow from it (see
:func:`~shardkit.checkpoint.formats.hf.writer.write_hf`).

Side files (``config.json``, tokenizer files) travel with the weights when
converting; only small config/tokenizer/text files are taken
(:func:`side_file_problem`), and each file left behind is named with the
reason in :attr:`HfReader.skipped_side_files` instead of failing the open.
"""

from __future__ import annotations

import fnmatch
import json
import math
from typing import Any, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import (
    CheckpointInfo,
    CheckpointReader,
    ReadRequest,
    StoredChunk,
    TensorEntry,
)
from shardkit.checkpoint.formats.dtypes import as_bytes, code_to_dtype
from shardkit.checkpoint.formats.hf.layout import (
    CONFIG_NAME,
    INDEX_NAME,
    SINGLE_NAME,
    is_head,
    ties_word_embeddings,
    weights_file,
)
from shardkit.checkpoint.formats.safetensors import read_safetensors_header
from shardkit.checkpoint.geometry.rows import (
    copy_rows_into,
    row_range,
)
from shardkit.checkpoint.io.names import check_name
from shardkit.checkpoint.io.storage import Storage, split_file
from shardkit.errors import (
    CheckpointNotFound,
    InvalidManifest,
    UnsafeCheckpoint,
)

__all__ = ["HfReader", "detect", "open_reader", "side_file_problem", "side_files_in", "INDEX_NAME",
           "SIDE_FILE_PATTERNS", "SIDE_FILE_CAP"]

SIDE_FILE_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py", "*.md", "merges.txt", "vocab.*")
SIDE_FILE_CAP = 64 << 20
# what a Trainer or DeepSpeed run keeps beside its weights that matches the patterns but is no model's file
TRAINING_RUN_FILES = ("trainer_state.json", "zero_to_fp32.py", "zero_to_torch.py")


def side_file_problem(storage: Storage, name: str) -> str | None:
    """Why ``name`` in an HF folder does not travel with the weights, or ``None`` when it does.

    Only the small files ``from_pretrained`` and tokenizers read are carried
    (:data:`SIDE_FILE_PATTERNS`, at most :data:`SIDE_FILE_CAP` bytes each):
    weights in other formats (``pytorch_model.bin``, ``*.gguf``), optimizer or
    training state would otherwise be copied along, and any size of them.
    """
    if not any(fnmatch.fnmatchcase(name, p) for p in SIDE_FILE_PATTERNS):
        return f"{name}: not a config, tokenizer or text file; not carried"
    if name in TRAINING_RUN_FILES:
        return f"{name}: a training run's own file, not the model's; not carried"
    try:
        check_name(name)
    except UnsafeCheckpoint:
        return f"{name}: not a plain file name (spaces, brackets or other characters); not carried"
    if storage.child(name).is_dir():
        return f"{name}: a directory; not carried"
    size = storage.size(name)
    if size > SIDE_FILE_CAP:
        return f"{name}: {size} bytes, over the {SIDE_FILE_CAP >> 20} MiB side-file cap; not carried"
    return None


def side_files_in(folder: Storage) -> tuple[list[str], list[str]]:
    """The side files of an HF folder (names), and one line per other file left behind, saying why.

    Weights (``*.safetensors``, the index) and hidden files are neither.
    """
    carried, skipped = [], []
    for n in folder.listdir():
        if n.endswith(".safetensors") or n == INDEX_NAME or n.startswith("."):
            continue
        problem = side_file_problem(folder, n)
        if problem is None:
            carried.append(n)
        else:
            skipped.append(problem)
    return carried, skipped


def detect(storage: Storage) -> bool:
    if storage.is_dir():
        return storage.exists(INDEX_NAME) or storage.exists(SINGLE_NAME)
    if not storage.url.endswith(".safetensors"):
        return False
    parent, name = split_file(storage)
    try:
        head = parent.read_bytes(name, 0, 9)
    except (FileNotFoundError, CheckpointNotFound):  # other failures (permissions, network) are real errors
        return False
    return len(head) == 9 and head[8:9] == b"{"


def open_reader(storage: Storage) -> "HfReader":
    return HfReader(storage)


class HfReader(CheckpointReader):
    """A safetensors file, or an HF folder (single file or shards + index), read by byte ranges."""

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        meta: dict[str, Any] = {}
        self.side_files: list[str] = []           # config/tokenizer files that travel with the weights
        self.skipped_side_files: list[str] = []   # one line per file left behind, saying why
        if storage.is_dir():
            self.folder = storage
            if weights_file(storage) == INDEX_NAME:
                try:
                    index = json.loads(storage.read_bytes(INDEX_NAME))
                    weight_map = index["weight_map"]
                    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                        raise TypeError("weight_map must map names to file names")
                except (ValueError, KeyError, TypeError) as exc:
                    raise InvalidManifest(f"{storage.where(INDEX_NAME)}: not a valid index ({exc})") from None
                names = sorted({check_name(v, storage.where(INDEX_NAME)) for v in weight_map.values()})
            else:
                weight_map, names = None, [SINGLE_NAME]
            self.side_files, self.skipped_side_files = side_files_in(storage)
        else:
            self.folder, name = split_file(storage)
            weight_map, names = None, [name]
        self._entries: dict[str, TensorEntry] = {}
        for name in names:
            header = read_safetensors_header(self.folder, name)
            meta.update(header.metadata)
            for key, e in header.entries.items():
                if weight_map is not None and weight_map.get(key) != name:
                    continue
                fqn = f"model.{key}"
                self._entries[fqn] = TensorEntry(fqn, code_to_dtype(e.dtype), e.shape,
                                                 (StoredChunk((0,) * len(e.shape), e.shape, (name, e.start)),))
        if weight_map is not None:
            missing = [k for k in weight_map if f"model.{k}" not in self._entries]
            if missing:
                raise InvalidManifest(f"{storage.where(INDEX_NAME)} names {missing[0]!r} but its shard does not "
                                      "hold it")
        self.info = CheckpointInfo("hf", storage.url, meta=meta)

    def tensors(self) -> Mapping[str, TensorEntry]:
        return self._entries

    def values(self) -> Mapping[str, Any]:
        return {}

    def declares_tied(self, fqn: str) -> bool:
        """An output head, when the folder's ``config.json`` ties word embeddings: ``from_pretrained`` then
        fills it from the input embeddings, and ``save_pretrained`` leaves it out of the files."""
        if not is_head(fqn) or CONFIG_NAME not in self.side_files:
            return False
        try:
            config = json.loads(self.folder.read_bytes(CONFIG_NAME))
        except (ValueError, UnicodeDecodeError, RecursionError):
            return False  # a config transformers cannot read ties nothing
        return isinstance(config, dict) and ties_word_embeddings(config)

    def read(self, requests: Sequence[ReadRequest]) -> None:
        checked = self.check_requests(requests)
        for r, entry in zip(requests, checked):
            if r.out.numel() == 0:
                continue
            name, start = entry.chunks[0].locator
            r0, r1 = row_range(entry.chunks[0].offsets, r.box)
            row = math.prod(entry.shape[1:]) * r.out.element_size()
            full_width = tuple(r.box[1][1:]) == tuple(entry.shape[1:])
            if full_width and r.out.is_contiguous():
                self.folder.read_into(name, start + r0 * row, as_bytes(r.out))
                self.stats.add(read=r.out.numel() * r.out.element_size(), requests=1)
                continue
            rows = torch.empty(((r1 - r0),) + tuple(entry.shape[1:]), dtype=entry.dtype)
            self.folder.read_into(name, start + r0 * row, as_bytes(rows))
            self.stats.add(read=rows.numel() * rows.element_size(), requests=1)
            copy_rows_into(rows, entry.chunks[0].offsets, r.box, r.out)
