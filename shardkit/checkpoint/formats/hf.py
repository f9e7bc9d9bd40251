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
import struct
from typing import Any, Callable

import torch

from shardkit.checkpoint.offline_io import Location, with_retries
from shardkit.checkpoint.offline_source import SavedChunk, TensorEntry, iter_row_blocks, nbytes_of, rows_per_block
from shardkit.errors import InvalidManifest, UnsupportedFormat

__all__ = ["HfSource", "is_hf", "write_hf", "plan_shards", "parse_size", "SAFETENSORS_DTYPES", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER = 100_000_000
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "C64": torch.complex64,
}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
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


def parse_header(loc: Location, name: str | None) -> tuple[dict[str, Any], dict[str, str], int]:
    """Read and validate one safetensors header: (entries, __metadata__, data start)."""
    where = loc.url if name is None else loc.child_url(name)
    size = loc.size(name)
    if size < 8:
        raise InvalidManifest(f"{where}: {size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", loc.read(name, 0, 8))
    if n > MAX_HEADER or n + 8 > size:
        raise InvalidManifest(f"{where}: safetensors header length {n} is impossible for a {size}-byte file")
    try:
        header = json.loads(loc.read(name, 8, 8 + n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidManifest(f"{where}: safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise InvalidManifest(f"{where}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InvalidManifest(f"{where}: __metadata__ must map strings to strings")
    data_start, data_len = 8 + n, size - 8 - n
    spans = []
    for key, e in header.items():
        if not isinstance(e, dict) or set(e) - {"dtype", "shape", "data_offsets"}:
            raise InvalidManifest(f"{where}: entry {key!r} is malformed")
        dtype = SAFETENSORS_DTYPES.get(e.get("dtype"))
        shape, offs = e.get("shape"), e.get("data_offsets")
        if dtype is None:
            raise InvalidManifest(f"{where}: entry {key!r} has unknown dtype {e.get('dtype')!r}")
        if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise InvalidManifest(f"{where}: entry {key!r} has an invalid shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1] <= data_len):
            raise InvalidManifest(f"{where}: entry {key!r} has data_offsets {offs!r} outside the file")
        if offs[1] - offs[0] != nbytes_of(dtype, tuple(shape)):
            raise InvalidManifest(f"{where}: entry {key!r} spans {offs[1] - offs[0]} bytes, its shape needs "
                                  f"{nbytes_of(dtype, tuple(shape))}")
        spans.append((offs[0], offs[1], key))
    spans.sort()
    end = 0
    for b, e, key in spans:
        if b < end:
            raise InvalidManifest(f"{where}: entry {key!r} overlaps the previous tensor")
        end = e
    if end != data_len:
        raise InvalidManifest(f"{where}: data section is {data_len} bytes but tensors cover {end} (truncated or padded)")
    return header, meta, data_start


def is_hf(loc: Location) -> bool:
    if loc.isdir():
        return loc.exists(INDEX_NAME) or loc.exists(SINGLE_NAME)
    if not loc.path.endswith(".safetensors"):
        return False
    head = loc.read(None, 0, 9) if loc.size() >= 9 else b""
    return len(head) == 9 and head[8:9] == b"{"


class HfSource:
    """A safetensors file, or an HF folder (single file or shards + index)."""

    format = "hf"

    def __init__(self, loc: Location) -> None:
        self.url = loc.url
        self._meta: dict[str, Any] = {}
        if loc.isdir():
            self._dir = loc
            if loc.exists(INDEX_NAME):
                try:
                    index = json.loads(loc.read(INDEX_NAME))
                    weight_map = index["weight_map"]
                    assert isinstance(weight_map, dict)
                except Exception as exc:
                    raise InvalidManifest(f"{loc.child_url(INDEX_NAME)}: not a valid index ({exc!r})") from exc
                files = sorted(set(weight_map.values()))
            else:
                weight_map, files = None, [SINGLE_NAME]
            names: list[str | None] = list(files)
            self.side_files = [n for n in loc.listdir() if not n.endswith(".safetensors") and n != INDEX_NAME
                               and not n.startswith(".")]
        else:
            parent = loc.path.rsplit("/", 1)[0] if "/" in loc.path else ""
            self._dir = Location(loc.url.rsplit("/", 1)[0] if "/" in loc.url else ".", loc.fs, parent)
            names, weight_map = [loc.path.rsplit("/", 1)[-1]], None
            self.side_files = []
        self._entries: dict[str, TensorEntry] = {}
        for name in names:
            header, meta, start = parse_header(self._dir, name)
            self._meta.update(meta)
            for key, e in header.items():
                if weight_map is not None and weight_map.get(key) != name:
                    continue
                shape = tuple(e["shape"])
                ref = (name, start + e["data_offsets"][0])
                fqn = f"model.{key}"
                self._entries[fqn] = TensorEntry(fqn, SAFETENSORS_DTYPES[e["dtype"]], shape,
                                                 (SavedChunk((0,) * len(shape), shape, ref),))
        if weight_map is not None:
            missing = [k for k in weight_map if f"model.{k}" not in self._entries]
            if missing:
                raise InvalidManifest(f"{self.url}: index names {missing[0]!r} but its shard does not hold it")

    def tensors(self) -> dict[str, TensorEntry]:
        return self._entries

    def values(self) -> dict[str, Any]:
        return {}

    def meta(self) -> dict[str, Any]:
        return dict(self._meta)

    @property
    def folder(self) -> Location:
        return self._dir

    def read_rows(self, entry: TensorEntry, chunk: SavedChunk, start: int, stop: int) -> torch.Tensor:
        name, base = chunk.ref
        if not entry.shape:
            start, stop = 0, 1
        row = math.prod(entry.shape[1:]) * torch.empty((), dtype=entry.dtype).element_size()
        n = (stop - start) * row
        shape = (stop - start,) + tuple(entry.shape[1:]) if entry.shape else ()
        if n == 0:
            return torch.empty(shape, dtype=entry.dtype)
        data = self._dir.read(name, base + start * row, base + start * row + n)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(entry.dtype).reshape(shape)

    def close(self) -> None:
        pass


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


def safetensors_header(items: list[tuple[str, torch.dtype, tuple[int, ...]]], meta: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header (space-padded to 8 bytes) for tensors laid out in order."""
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    pos = 0
    for key, dtype, shape in items:
        if dtype not in DTYPE_NAMES:
            raise UnsupportedFormat(f"{key}: dtype {dtype} has no safetensors name")
        n = nbytes_of(dtype, shape)
        header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_hf(dst: Location, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
             fetch: Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor], *, block_bytes: int,
             max_shard_size: int, on_bytes: Callable[[int], None] = lambda n: None,
             before_index: Callable[[], None] = lambda: None) -> list[str]:
    """Write HF shards + index for model tensors (``model.<key>`` → ``<key>``); return file names.

    The index is written last (after ``before_index``, which copies side files):
    it is what makes the folder a checkpoint, so a failure leaves none.
    """
    items = [(fqn[len("model."):], dtype, shape) for fqn, dtype, shape in tensors]
    shards = plan_shards(items, max_shard_size)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map: dict[str, str] = {}
    for name, idx in zip(names, shards):
        shard_items = [items[i] for i in idx]
        with with_retries(dst.child_url(name), lambda: dst.fs.open(dst.child(name), "wb")) as out:
            out.write(safetensors_header(shard_items, {"format": "pt"}))
            for i in idx:
                fqn, dtype, shape = tensors[i]
                weight_map[items[i][0]] = name
                if not shape:
                    out.write(_raw(fetch(fqn, (), ())))
                    continue
                for r0, r1 in iter_row_blocks(shape[0], rows_per_block(dtype, shape, block_bytes)):
                    data = _raw(fetch(fqn, (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])))
                    with_retries(dst.child_url(name), lambda: out.write(data))
                    on_bytes(len(data))
    total = sum(nbytes_of(d, s) for _, d, s in items)
    before_index()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with_retries(dst.child_url(INDEX_NAME), lambda: dst.fs.pipe_file(dst.child(INDEX_NAME),
                                                                     json.dumps(index, indent=2).encode()))
    return names + [INDEX_NAME]


def _raw(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
