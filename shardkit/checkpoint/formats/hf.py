"""Hugging Face safetensors checkpoints: one ``model.safetensors`` or shards + index.

Reading parses each file's safetensors header with a ranged read and checks it
strictly (header length cap, JSON shape, dtypes, offsets inside the file, no
overlaps or holes) before any tensor byte is trusted; tensors are then read a
block of rows at a time with ranged reads, never the whole file.

Writing follows the conventions ``transformers``/``huggingface_hub`` use:
shards filled greedily in key order up to ``max_shard_size`` (a tensor larger
than the cap gets a shard of its own), named ``model-0000k-of-0000N.safetensors``,
always a ``model.safetensors.index.json`` with ``metadata.total_size``, and
``__metadata__ = {"format": "pt"}`` in every header.  Each shard is streamed:
its header is computed from the plan, then rows are appended block by block.

Names: an HF key ``k`` is the model tensor ``model.k`` in shardkit's
flattened naming; HF holds model weights only.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Mapping, Sequence

import torch

from shardkit.checkpoint.codec import (SafetensorsStreamWriter, as_bytes, code_to_dtype,
                                       dtype_to_code, parse_safetensors_header)
from shardkit.checkpoint.formats.base import CheckpointInfo, CheckpointReader, ReadRequest, StoredChunk, TensorEntry
from shardkit.checkpoint.offline_blocks import (copy_rows_into, is_dir, iter_row_blocks, nbytes_of, row_range,
                                                rows_per_block, split_file)
from shardkit.checkpoint.storage import Storage
from shardkit.errors import IncompatibleStateDict, InvalidManifest, UnsupportedFormat

__all__ = ["HfReader", "detect", "open_reader", "write_hf", "plan_shards", "parse_size", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_HEAD_GUESS = 1 << 16
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` → 5e9, ``"64MiB"`` → 2**26, ``1000`` → 1000 (the HF spelling of sizes)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise UnsupportedFormat(f"size {text!r} is not understood; write e.g. 5GB, 500MB or 64MiB")
    try:
        return int(float(num) * _UNITS[unit])
    except ValueError as exc:
        raise UnsupportedFormat(f"size {text!r} is not understood; write e.g. 5GB, 500MB or 64MiB") from exc


def read_header(storage: Storage, name: str) -> Any:
    """Parse and strictly validate one safetensors header with ranged reads (codec's parser)."""
    size = storage.size(name)
    prefix = storage.read_bytes(name, 0, min(size, _HEAD_GUESS))
    return parse_safetensors_header(prefix, size, storage.where(name),
                                    lambda n: storage.read_bytes(name, 0, n))


def detect(storage: Storage) -> bool:
    if is_dir(storage):
        return storage.exists(INDEX_NAME) or storage.exists(SINGLE_NAME)
    if not storage.url.endswith(".safetensors"):
        return False
    parent, name = split_file(storage)
    try:
        head = parent.read_bytes(name, 0, 9)
    except Exception:  # noqa: BLE001 - unreadable means "not this format"
        return False
    return len(head) == 9 and head[8:9] == b"{"


def open_reader(storage: Storage) -> "HfReader":
    return HfReader(storage)


class HfReader(CheckpointReader):
    """A safetensors file, or an HF folder (single file or shards + index), read by byte ranges."""

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        meta: dict[str, Any] = {}
        if is_dir(storage):
            self.folder = storage
            if storage.exists(INDEX_NAME):
                try:
                    index = json.loads(storage.read_bytes(INDEX_NAME))
                    weight_map = index["weight_map"]
                    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                        raise TypeError("weight_map must map names to file names")
                except (ValueError, KeyError, TypeError) as exc:
                    raise InvalidManifest(f"{storage.where(INDEX_NAME)}: not a valid index ({exc})") from None
                names = sorted(set(weight_map.values()))
            else:
                weight_map, names = None, [SINGLE_NAME]
            self.side_files = [n for n in storage.listdir() if not n.endswith(".safetensors") and n != INDEX_NAME
                               and not n.startswith(".") and not is_dir(storage.child(n))]
        else:
            self.folder, name = split_file(storage)
            weight_map, names = None, [name]
            self.side_files = []
        self._entries: dict[str, TensorEntry] = {}
        for name in names:
            header = read_header(self.folder, name)
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

    def read(self, requests: Sequence[ReadRequest]) -> None:
        checked = []
        for r in requests:
            entry = self._entries.get(r.fqn)
            if entry is None or r.chunk != 0 or r.out.dtype != entry.dtype or tuple(r.out.shape) != tuple(r.box[1]):
                raise IncompatibleStateDict(f"{r.fqn!r}: request does not match {self.info.url}")
            checked.append(entry)
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


# --------------------------------------------------------------------------
# writing


def plan_shards(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_size: int) -> list[list[int]]:
    """Greedy in key order, like ``split_state_dict_into_shards_factory``: indices per shard."""
    shards: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (_, dtype, shape) in enumerate(tensors):
        n = nbytes_of(dtype, shape)
        if current and size + n > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


def write_hf(dst: Storage, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
             fetch: Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor], *, block_bytes: int,
             max_shard_size: int, on_bytes: Callable[[int], None] = lambda n: None,
             before_index: Callable[[], None] = lambda: None) -> list[str]:
    """Write HF shards + index for model tensors (``model.<key>`` → ``<key>``); return file names.

    ``fetch(fqn, offsets, shape)`` returns a box of rows; each shard is streamed
    (header first) a block of at most ``block_bytes`` at a time.  The index is
    written last (after ``before_index``, which copies side files): it is what
    makes the folder a checkpoint, so a failure leaves none.
    """
    items = [(fqn[len("model."):], dtype, shape) for fqn, dtype, shape in tensors]
    shards = plan_shards(items, max_shard_size)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map: dict[str, str] = {}
    for name, idx in zip(names, shards):
        entries = [(items[i][0], dtype_to_code(items[i][1]), items[i][2], nbytes_of(items[i][1], items[i][2]))
                   for i in idx]

        def produce(out: Any, idx: list[int] = idx, entries: list = entries) -> None:
            stream = SafetensorsStreamWriter(out, entries, {"format": "pt"}, block_size=1 << 30)
            for i in idx:
                fqn, dtype, shape = tensors[i]
                key = items[i][0]
                if not shape:
                    stream.write(key, as_bytes(fetch(fqn, (), ()).contiguous()))
                    continue
                for r0, r1 in iter_row_blocks(shape[0], rows_per_block(dtype, shape, block_bytes)):
                    block = fetch(fqn, (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])).contiguous()
                    stream.write(key, as_bytes(block) if block.numel() else torch.empty(0, dtype=torch.uint8))
                    on_bytes(block.numel() * block.element_size())
            stream.finish()

        dst.write_stream(name, produce, fsync=False)
        for i in idx:
            weight_map[items[i][0]] = name
    total = sum(nbytes_of(d, s) for _, d, s in items)
    before_index()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    dst.put_atomic(INDEX_NAME, json.dumps(index, indent=2).encode())
    return names + [INDEX_NAME]
