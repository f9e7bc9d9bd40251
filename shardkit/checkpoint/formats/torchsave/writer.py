"""Writing torch.save files in bounded memory: the pickle torch.save would write (``data.pkl``,
built by :mod:`~shardkit.checkpoint.formats.pickle_ops`, no tensor in memory) and each tensor's
storage record streamed a block of rows at a time into the zip archive, aligned as torch aligns it."""


from __future__ import annotations

import math
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import (
    Fetch,
    contiguous_strides,
)
from shardkit.checkpoint.formats.pickle_ops import (
    Call,
    Global,
    Persistent,
    PickleTuple,
    encode,
)
from shardkit.checkpoint.formats.torchsave.reader import STORAGE_TYPES, value_path
from shardkit.checkpoint.geometry.rows import (
    iter_row_blocks,
    rows_per_block,
)
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.tree import from_json_value
from shardkit.errors import (
    UnsupportedFormat,
)

__all__ = ["write_torch_save", "write_archive", "check_tensors", "TensorRef", "UNTYPED_STORAGE_DTYPES"]

_ALIGN = 64
_ARCHIVE = "archive"
# dtypes torch.save writes as an UntypedStorage and _rebuild_tensor_v3 (no typed storage class exists)
UNTYPED_STORAGE_DTYPES = frozenset(getattr(torch, name) for name in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))


def check_tensors(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
    """Refuse, before anything is written, a tensor whose dtype a torch.save file cannot hold here.

    Called by the offline tools ahead of touching DST, so an old checkpoint
    there is never removed for a conversion that would fail midway.
    """
    for fqn, dtype, _ in tensors:
        if dtype not in STORAGE_TYPES and dtype not in UNTYPED_STORAGE_DTYPES:
            supported = sorted(str(d).replace("torch.", "") for d in (*STORAGE_TYPES, *UNTYPED_STORAGE_DTYPES))
            raise UnsupportedFormat(f"{fqn!r} is {dtype}, which torch.save/DCP output cannot hold (supported: "
                                    f"{', '.join(supported)}); exclude it or cast it with --dtype")


@dataclass(frozen=True)
class TensorRef:
    """A tensor placeholder in the object a torch.save archive holds.

    Its data is rows ``[first_row, first_row + shape[0])`` of ``fqn``, pulled
    from ``fetch`` a block at a time when the archive's record ``key`` is
    written (a DCP payload is one chunk of a tensor, hence ``first_row``).
    """

    key: str
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    first_row: int = 0


def _rebuild(ref: Any) -> Call | None:
    """The ``data.pkl`` form of a tensor, as torch.save writes it: ``_rebuild_tensor_v2`` of a
    persistent storage reference, contiguous strides, no grad, no hooks -- or, for a dtype with no
    typed storage class (float8), ``_rebuild_tensor_v3`` of an ``UntypedStorage`` of its bytes, with
    the dtype last."""
    if not isinstance(ref, TensorRef):
        return None
    args = (0, PickleTuple(ref.shape), PickleTuple(contiguous_strides(ref.shape)), False,
            Call("collections", "OrderedDict", ()))
    if ref.dtype in STORAGE_TYPES:
        storage = Persistent(("storage", Global("torch", STORAGE_TYPES[ref.dtype]), ref.key, "cpu",
                              math.prod(ref.shape)))
        return Call("torch._utils", "_rebuild_tensor_v2", (storage, *args))
    storage = Persistent(("storage", Global("torch.storage", "UntypedStorage"), ref.key, "cpu",
                          math.prod(ref.shape) * ref.dtype.itemsize))
    return Call("torch._utils", "_rebuild_tensor_v3", (storage, *args, ref.dtype))


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for key, value in flat.items():
        node = root
        path = value_path(key)
        for part in path[:-1]:
            node = node.setdefault(str(part), {})
            if not isinstance(node, dict):
                raise UnsupportedFormat(f"{key!r} cannot be nested: a value already sits at one of its parents")
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


def write_archive(sink: Any, root: Any, refs: Sequence[TensorRef], fetch: Fetch, *, block_bytes: int,
                  on_bytes: Callable[[int], None] = lambda n: None) -> int:
    """Stream one torch.save archive holding ``root`` into ``sink``; return its size in bytes.

    ``root`` is any JSON-like object in which :class:`TensorRef` s stand for
    tensors; each ref's record is filled from ``fetch`` in dim-0 blocks of at
    most ``block_bytes``, so memory is one block whatever the tensor size.
    Offsets inside the archive are relative to its first byte, so archives
    can be concatenated (DCP payload files are).
    """
    pickled = encode(root, _rebuild)
    raw = _Counted(sink)
    with zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        def record(name: str, data: bytes) -> None:
            with zf.open(_zip_info(f"{_ARCHIVE}/{name}", raw.tell()), "w", force_zip64=True) as f:
                f.write(data)

        record("data.pkl", pickled)
        record(".format_version", b"1")
        record(".storage_alignment", str(_ALIGN).encode())
        record("byteorder", b"little")
        for ref in refs:
            with zf.open(_zip_info(f"{_ARCHIVE}/data/{ref.key}", raw.tell()), "w", force_zip64=True) as f:
                rest = tuple(ref.shape[1:])
                blocks = iter_row_blocks(ref.shape[0], rows_per_block(ref.dtype, ref.shape, block_bytes)) \
                    if ref.shape else [(0, 1)]
                for r0, r1 in blocks:
                    if ref.shape:
                        t = fetch(ref.fqn, (ref.first_row + r0,) + (0,) * len(rest), (r1 - r0,) + rest)
                    else:
                        t = fetch(ref.fqn, (), ())
                    f.write(_as_bytes(t))
                    on_bytes(t.numel() * t.element_size())
        record("version", b"3")
    return raw.tell()


def write_torch_save(dst: Storage, name: str, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                     values: Mapping[str, Any], fetch: Fetch, *, block_bytes: int,
                     on_bytes: Callable[[int], None] = lambda n: None) -> None:
    """Write file ``name`` in ``dst``, readable by ``torch.load(weights_only=True)``, in bounded memory.

    ``values`` are JSON-encoded (flatten's form); they are decoded here so that
    ``inf``/``nan`` come back as floats, not as ``{"$float": ...}`` dicts.
    """
    check_tensors(tensors)
    refs = {fqn: TensorRef(str(i), fqn, dtype, tuple(shape)) for i, (fqn, dtype, shape) in enumerate(tensors)}
    root = _nest({**{k: from_json_value(v) for k, v in values.items()}, **refs})
    # The file is its own commit marker (a file already at ``name`` stays whole until the new one is complete).
    dst.write_then_replace(name, lambda sink: write_archive(sink, root, list(refs.values()), fetch,
                                                            block_bytes=block_bytes, on_bytes=on_bytes))


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
