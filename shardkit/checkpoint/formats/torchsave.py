"""torch.save files (``.pt``/``.bin``): read with mmap, write tensor by tensor.

Reading uses ``torch.load(weights_only=True, mmap=True)``: tensors stay backed
by the file, so only the rows being converted are paged in.  A remote file is
first copied to a local temporary file (disk, not memory) so it can be mapped.

Writing does not call ``torch.save`` on a state dict, which would need the
whole dict in memory.  A torch.save file is a zip archive: a small
``data.pkl`` that rebuilds every tensor from named storages, plus one stored
(uncompressed) record per storage.  We emit ``data.pkl`` directly as a short
sequence of pickle protocol-2 opcodes (dicts, strings, numbers and the same
``_rebuild_tensor_v2`` calls ``torch.save`` emits — all on the allowlist of
``torch.load(weights_only=True)``), then stream each storage record in row
blocks, 64-byte aligned like torch's own writer so ``mmap=True`` works.
Memory is one row block, whatever the model size.
"""

from __future__ import annotations

import os
import struct
import tempfile
import zipfile
from typing import Any, Callable, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import CheckpointInfo, CheckpointReader, ReadRequest, StoredChunk, TensorEntry
from shardkit.checkpoint.offline_blocks import (copy_rows_into, is_dir, iter_row_blocks, object_path, row_range,
                                                rows_per_block, split_file)
from shardkit.checkpoint.storage import Storage
from shardkit.errors import IncompatibleStateDict, InvalidManifest, UnsafeCheckpoint, UnsupportedFormat

__all__ = ["TorchSaveReader", "detect", "open_reader", "write_torch_save", "flatten_state"]

_STORAGE_TYPES = {
    torch.float32: "FloatStorage", torch.float64: "DoubleStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage",
}
_ALIGN = 64
_ARCHIVE = "archive"


def detect(storage: Storage) -> bool:
    """A torch.save file is a zip archive (``PK\\x03\\x04``); directories never are."""
    if is_dir(storage):
        return False
    try:
        parent, name = split_file(storage)
        return parent.read_bytes(name, 0, 4) == b"PK\x03\x04"
    except Exception:  # noqa: BLE001 - unreadable means "not this format"
        return False


def open_reader(storage: Storage) -> "TorchSaveReader":
    return TorchSaveReader(storage)


def flatten_state(obj: Any, where: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Nested state dict → (flattened tensors, JSON values), keys joined by ``.``.

    A top level without ``model``/``optim`` sub-dicts is a bare model state dict
    and is placed under ``model.``.
    """
    if not isinstance(obj, dict):
        raise UnsupportedFormat(f"{where}: holds a {type(obj).__name__}, not a state dict")
    if not any(k in obj and isinstance(obj[k], dict) for k in ("model", "optim")):
        obj = {"model": obj}
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}

    def has_tensor(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return True
        if isinstance(v, dict):
            return any(has_tensor(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return any(has_tensor(x) for x in v)
        return False

    def visit(key: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            tensors[key] = v
        elif isinstance(v, dict) and has_tensor(v):
            for k, x in v.items():
                visit(f"{key}.{k}" if key else str(k), x)
        elif isinstance(v, (list, tuple)) and has_tensor(v):
            for i, x in enumerate(v):
                visit(f"{key}.{i}", x)
        else:
            values[key] = _json_value(v, f"{where} [{key}]")

    visit("", obj)
    return tensors, values


def _json_value(v: Any, where: str) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_json_value(x, where) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_value(x, where) for k, x in v.items()}
    raise UnsupportedFormat(f"{where}: a {type(v).__name__} cannot be carried as a JSON value")


class TorchSaveReader(CheckpointReader):
    """A torch.save file, memory-mapped; tensors are served a request at a time."""

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self._tmp: str | None = None
        parent, name = split_file(storage)
        path = parent.path(name) if parent.is_local else None
        if path is None:  # remote: spool to local disk so the file can be memory-mapped
            fd, self._tmp = tempfile.mkstemp(suffix=".pt", prefix="shardkit-")
            os.close(fd)
            parent._retry(f"downloading {storage.url}", lambda: parent.fs.get_file(parent.path(name), self._tmp))
            path = self._tmp
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
            msg = (str(exc).splitlines() or [type(exc).__name__])[0]
            self.close()
            if "weights_only" in str(exc) or "Unsupported global" in str(exc):
                raise UnsafeCheckpoint(f"{storage.url}: needs unsafe unpickling to load ({msg}); refusing") from None
            raise InvalidManifest(f"{storage.url}: not a readable torch.save file ({msg})") from None
        self._tensors, self._values = flatten_state(obj, storage.url)
        self._entries = {k: TensorEntry(k, t.dtype, tuple(t.shape), (StoredChunk((0,) * t.dim(), tuple(t.shape), k),))
                         for k, t in self._tensors.items()}
        self.info = CheckpointInfo("torch", storage.url)

    def tensors(self) -> Mapping[str, TensorEntry]:
        return self._entries

    def values(self) -> Mapping[str, Any]:
        return self._values

    def read(self, requests: Sequence[ReadRequest]) -> None:
        for r in requests:
            entry = self._entries.get(r.fqn)
            if entry is None or r.chunk != 0 or r.out.dtype != entry.dtype or tuple(r.out.shape) != tuple(r.box[1]):
                raise IncompatibleStateDict(f"{r.fqn!r}: request does not match {self.info.url}")
        for r in requests:
            t = self._tensors[r.fqn]
            r0, r1 = row_range(self._entries[r.fqn].chunks[0].offsets, r.box)
            rows = t if t.dim() == 0 else t[r0:r1]
            copy_rows_into(rows, self._entries[r.fqn].chunks[0].offsets, r.box, r.out)
            _release(rows)
            self.stats.add(read=r.out.numel() * r.out.element_size(), requests=1)

    def close(self) -> None:
        self._tensors = {}
        if self._tmp:
            os.unlink(self._tmp)
            self._tmp = None


# --------------------------------------------------------------------------
# writing: a pickle opcode stream built by hand (no pickle module)


class _Ops:
    """The few protocol-2 opcodes a state dict needs."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")

    def value(self, v: Any) -> None:
        o = self.out
        if v is None:
            o += b"N"
        elif v is True:
            o += b"\x88"
        elif v is False:
            o += b"\x89"
        elif isinstance(v, int):
            if -(2 ** 31) <= v < 2 ** 31:
                o += b"J" + struct.pack("<i", v)
            else:
                raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
                o += b"\x8a" + bytes([len(raw)]) + raw
        elif isinstance(v, float):
            o += b"G" + struct.pack(">d", v)
        elif isinstance(v, str):
            raw = v.encode("utf-8")
            o += b"X" + struct.pack("<I", len(raw)) + raw
        elif isinstance(v, (list, tuple)) and not isinstance(v, _Tuple):
            o += b"]("
            for x in v:
                self.value(x)
            o += b"e"
        elif isinstance(v, _Tuple):
            o += b"("
            for x in v:
                self.value(x)
            o += b"t"
        elif isinstance(v, dict):
            o += b"}("
            for k, x in v.items():
                self.value(str(k))
                self.value(x)
            o += b"u"
        elif isinstance(v, _TensorRef):
            self.tensor(v)
        else:
            raise UnsupportedFormat(f"cannot write a {type(v).__name__} into a torch.save file")

    def glob(self, module: str, name: str) -> None:
        self.out += b"c" + f"{module}\n{name}\n".encode()

    def tensor(self, ref: "_TensorRef") -> None:
        stride, acc = [], 1
        for n in reversed(ref.shape):
            stride.insert(0, acc)
            acc *= n
        self.glob("torch._utils", "_rebuild_tensor_v2")
        self.out += b"(("
        self.value("storage")
        self.glob("torch", _STORAGE_TYPES[ref.dtype])
        self.value(ref.key)
        self.value("cpu")
        self.value(ref.numel)
        self.out += b"tQ"
        self.value(0)
        self.value(_Tuple(ref.shape))
        self.value(_Tuple(stride))
        self.value(False)
        self.glob("collections", "OrderedDict")
        self.out += b")Rt" + b"R"


class _Tuple(tuple):
    pass


class _TensorRef:
    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if dtype not in _STORAGE_TYPES:
            raise UnsupportedFormat(f"dtype {dtype} cannot be written to a torch.save file")
        self.key, self.dtype, self.shape = key, dtype, tuple(shape)
        self.numel = 1
        for n in shape:
            self.numel *= n


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for key, value in flat.items():
        node = root
        path = object_path(key)
        for part in path[:-1]:
            node = node.setdefault(str(part), {})
        node[str(path[-1])] = value
    return root


def _zip_info(name: str, at: int) -> zipfile.ZipInfo:
    """A stored record whose data starts on a 64-byte boundary (padding in the extra field)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    header = 30 + len(name.encode()) + 20  # + the zip64 extra zipfile adds with force_zip64
    pad = (-(at + header + 4)) % _ALIGN
    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding, as torch's writer uses
    return info


def write_torch_save(dst: Storage, name: str, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                     values: dict[str, Any], fetch: Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor],
                     *, block_bytes: int, on_bytes: Callable[[int], None] = lambda n: None) -> None:
    """Write file ``name`` in ``dst``, readable by ``torch.load(weights_only=True)``, in bounded memory."""
    refs = {fqn: _TensorRef(str(i), dtype, shape) for i, (fqn, dtype, shape) in enumerate(tensors)}
    ops = _Ops()
    ops.value(_nest({**values, **refs}))
    ops.out += b"."

    def produce(sink: Any) -> None:
        raw = _Counted(sink)
        with zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            def record(rec: str, data: bytes) -> None:
                with zf.open(_zip_info(f"{_ARCHIVE}/{rec}", raw.tell()), "w", force_zip64=True) as f:
                    f.write(data)

            record("data.pkl", bytes(ops.out))
            record(".format_version", b"1")
            record(".storage_alignment", str(_ALIGN).encode())
            record("byteorder", b"little")
            for fqn, dtype, shape in tensors:
                with zf.open(_zip_info(f"{_ARCHIVE}/data/{refs[fqn].key}", raw.tell()), "w", force_zip64=True) as f:
                    if not shape:
                        f.write(_as_bytes(fetch(fqn, (), ())))
                        continue
                    for r0, r1 in iter_row_blocks(shape[0], rows_per_block(dtype, shape, block_bytes)):
                        t = fetch(fqn, (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:]))
                        f.write(_as_bytes(t))
                        on_bytes(t.numel() * t.element_size())
            record("version", b"3")

    # The file is its own commit marker: locally write a temporary name and rename it into place;
    # on object stores (no atomic rename) write in place and delete the object on failure.
    target = f".{name}.partial-{os.getpid()}" if dst.is_local else name
    try:
        dst.write_stream(target, produce, fsync=dst.is_local)
        if dst.is_local:
            os.replace(dst.path(target), dst.path(name))
    except BaseException:
        try:
            dst.delete([target])
        except Exception:  # noqa: BLE001 - the original failure is what the user needs to see
            pass
        raise


def _release(rows: torch.Tensor) -> None:
    """Drop the mapped file pages just copied from (``MADV_DONTNEED``) so they leave this process's
    RSS; the mapping is private and unmodified, so a later read simply faults them in again."""
    n = rows.numel() * rows.element_size()
    if n < (1 << 20) or not rows.is_contiguous():
        return
    try:
        import ctypes
        import mmap

        page = mmap.PAGESIZE
        lo = -(-rows.data_ptr() // page) * page
        hi = (rows.data_ptr() + n) // page * page
        if hi > lo:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED
    except (OSError, AttributeError, ValueError):
        pass


class _Counted:
    """A forward-only sink that knows its position: zipfile then streams (data descriptors, no seeks),
    which works on any file object storage hands us (local, O_DIRECT, multipart upload)."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink
        self._pos = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self._sink.write(data)
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        flush = getattr(self._sink, "flush", None)
        if flush is not None:
            flush()


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
