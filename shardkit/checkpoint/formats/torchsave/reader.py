"""torch.save files (``.pt``/``.bin``): read with mmap, write tensor by tensor.

Reading uses ``torch.load(weights_only=True, mmap=True)``: tensors stay backed
by the file, so only the rows being converted are paged in.  A remote file is
first copied to a local temporary file (disk, not memory) so it can be mapped.
torch.load checks no CRC-32, so the reader checks each zip record's before
serving its bytes (:mod:`.zip_records`).  A file that needs classes outside
the ``weights_only`` allowlist is refused, naming the class, unless the user
trusts it (``trust_pickle``, :class:`TorchLoadOptions`).  What the unpickled
object means as a state dict (classic ``{"model", "optimizer"}`` files,
optimizer state keyed by parameter number) is :mod:`.torch_state`'s concern.

Writing does not call ``torch.save`` on a state dict, which would need the
whole dict in memory.  A torch.save file is a zip archive: a small
``data.pkl`` that rebuilds every tensor from named storages, plus one stored
(uncompressed) record per storage.  We emit ``data.pkl`` directly as a short
sequence of pickle protocol-2 opcodes (:mod:`.pickle_ops`: dicts, strings,
numbers and the same ``_rebuild_tensor_v2`` calls ``torch.save`` emits — all on
the allowlist of ``torch.load(weights_only=True)``), then stream each storage
record in row blocks, 64-byte aligned like torch's own writer so ``mmap=True``
works.  Memory is one row block, whatever the model size.  DCP payloads are
the same archives (:func:`write_archive`), one per chunk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import (
    CheckpointInfo,
    CheckpointReader,
    ReadRequest,
    StoredChunk,
    TensorEntry,
)
from shardkit.checkpoint.formats.torchsave.state import flatten_state
from shardkit.checkpoint.formats.torchsave.zip_records import (
    CheckedOnce,
    ZipRecord,
    carries_checksums,
    check_record,
    data_start,
    list_records,
)
from shardkit.checkpoint.geometry.rows import (
    copy_rows_into,
    row_range,
)
from shardkit.checkpoint.io.files import download
from shardkit.checkpoint.io.storage import Storage, split_file
from shardkit.checkpoint.state.tree import object_path
from shardkit.errors import (
    CheckpointNotFound,
    InvalidManifest,
    ShardkitError,
    UnsafeCheckpoint,
)

__all__ = ["TorchSaveReader", "TorchLoadOptions", "detect", "open_reader", "refusal", "value_path", "STORAGE_TYPES"]

log = logging.getLogger(__name__)


STORAGE_TYPES = {
    torch.float32: "FloatStorage", torch.float64: "DoubleStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage",
}
_ALIGN = 64
_ARCHIVE = "archive"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch's refusal message carries terminal bold codes


def detect(storage: Storage) -> bool:
    """A torch.save file is a zip archive (``PK\\x03\\x04``); directories never are."""
    if storage.is_dir():
        return False
    try:
        parent, name = split_file(storage)
        return parent.read_bytes(name, 0, 4) == b"PK\x03\x04"
    except (FileNotFoundError, CheckpointNotFound):  # other failures (permissions, network) are real errors
        return False


@dataclass(frozen=True)
class TorchLoadOptions:
    """How the offline tools open a torch.save source.

    ``trust_pickle``: unpickle the file without torch's ``weights_only``
    allowlist, for a file whose origin the user trusts.  UNSAFE on anything
    else: unpickling runs whatever code the file names.  ``model_keys``: the
    parameter FQNs in ``model.named_parameters()`` order, naming an optimizer
    state keyed by number; ``need_names``: refuse numbered optimizer state
    that cannot be named (a conversion that writes it) instead of keeping the
    numbers as keys (see :mod:`.state`).
    """

    trust_pickle: bool = False
    model_keys: tuple[str, ...] | None = None
    need_names: bool = False

    def is_set(self) -> bool:
        """Whether these options ask for something only a torch.save source can do."""
        return self.trust_pickle or self.model_keys is not None

    def refused_for(self, fmt: str) -> str:
        """Why a checkpoint of format ``fmt`` cannot take these options (the registry's refusal)."""
        return f"--trust-pickle and --model-keys apply to torch.save sources, and this is a {fmt} checkpoint"


def open_reader(storage: Storage, torch_options: TorchLoadOptions | None = None) -> "TorchSaveReader":
    return TorchSaveReader(storage, torch_options)


def refusal(exc: BaseException) -> str | None:
    """What ``torch.load(weights_only=True)`` refused, in one line naming the class (``GLOBAL
    mymodule.MyClass``); ``None`` when ``exc`` is not such a refusal.  torch's message starts with a
    paragraph on how to bypass the check; the class is named further down."""
    text = _ANSI.sub("", str(exc))
    if not any(s in text for s in ("weights_only", "Weights only", "WeightsUnpickler", "Unsupported global")):
        return None
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return f"{found.group(1)} is not on torch.load's weights_only allowlist"
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()
    return (text.strip().splitlines() or [type(exc).__name__])[0]


def value_path(key: str) -> tuple[str | int, ...]:
    """Where a flattened key lives in the nested dict a torch.save/DCP file holds.

    Model and optimizer keys follow :func:`object_path` (parameter names contain
    dots); other keys were joined by flatten from nested dicts, so their dots
    are path separators (``extra.best_loss`` -> ``extra`` / ``best_loss``).
    """
    path = object_path(key)
    return path if len(path) > 1 else tuple(key.split("."))


class TorchSaveReader(CheckpointReader):
    """A torch.save file, memory-mapped; tensors are served a request at a time.

    Every zip record is checked against its CRC-32 before its bytes are used
    (:mod:`.zip_records`): ``data.pkl`` and the other small records at open,
    each tensor's storage record the first time one of its rows is read.
    """

    def __init__(self, storage: Storage, options: TorchLoadOptions | None = None) -> None:
        super().__init__()
        opts = options or TorchLoadOptions()
        self._tmp: str | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._record_of: dict[str, ZipRecord] = {}
        self._data_at: dict[str, int] = {}
        self._checked = CheckedOnce()
        self.skipped_side_files: list[str] = []  # what a trusted file held that no checkpoint can (notes)
        url = storage.url
        try:
            self._file, self._name, path = self._local_file(storage)
            self._size = self._file.size(self._name)
            records = list_records(self._file, self._name, 0, self._size, url)
            crc = carries_checksums(records)
            if crc:  # data.pkl and the other small records, before anything is unpickled from them
                for rec in records:
                    if "/data/" not in rec.name:
                        self._check(rec, url)
            else:
                log.warning("%s: written without CRC-32s (torch's save.compute_crc32=False); its bytes cannot be "
                            "checked", url)
            if opts.trust_pickle:
                log.warning("%s: unpickling with trust_pickle=True: the weights_only allowlist is off and any "
                            "code the file names runs; use this only on files you trust", url)
            obj = torch.load(path, map_location="cpu", weights_only=not opts.trust_pickle, mmap=True)
            state = flatten_state(obj, url, model_keys=opts.model_keys, need_names=opts.need_names,
                                  trusted=opts.trust_pickle)
            self._tensors, self._values, self.skipped_side_files = state.tensors, state.values, state.notes
            if crc:
                self._map_records(url, records)
        except BaseException as exc:
            self.close()  # a failed download, a bad file or unreadable contents leave no spool file behind
            if isinstance(exc, ShardkitError) or not isinstance(exc, Exception):
                raise
            refused = refusal(exc)
            if refused and not opts.trust_pickle:
                raise UnsafeCheckpoint(f"{url}: refusing to unpickle it: {refused}, and loading it could run code "
                                       "the file names; if you trust this file, pass --trust-pickle "
                                       "(trust_pickle=True in Python; unsafe on untrusted files)") from None
            msg = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise InvalidManifest(f"{url}: not a readable torch.save file ({msg})") from None
        self._entries = {k: TensorEntry(k, t.dtype, tuple(t.shape), (StoredChunk((0,) * t.dim(), tuple(t.shape), k),))
                         for k, t in self._tensors.items()}
        self.info = CheckpointInfo("torch", url)

    def _local_file(self, storage: Storage) -> tuple[Storage, str, str]:
        """(folder, name, path) of the file on local disk; a remote file is spooled to a temporary file
        first so it can be mapped."""
        parent, name = split_file(storage)
        if parent.is_local:
            return parent, name, parent.path(name)
        fd, self._tmp = tempfile.mkstemp(suffix=".pt", prefix="shardkit-")
        os.close(fd)
        tmp = self._tmp
        download(parent, name, tmp)
        return Storage(os.path.dirname(tmp)), os.path.basename(tmp), tmp

    def _map_records(self, url: str, records: list[ZipRecord]) -> None:
        """Find the storage record holding each tensor's bytes, so each is checked when first read.

        ``mmap=True`` maps the whole file once and makes each storage a slice
        of that mapping starting at its record's bytes, so the storages'
        addresses minus the records' data offsets are one constant.  When the
        non-empty storages and records pair up one to one under that constant
        (sizes agreeing), each tensor's record is known; anything else (a
        torch that maps otherwise) tells us nothing, and then every record is
        checked now, before any byte is served.
        """
        data = {data_start(self._file, self._name, 0, r, url): r for r in records if "/data/" in r.name and r.size}
        by_address: dict[int, list[str]] = {}
        for key, t in self._tensors.items():
            storage = t.untyped_storage()
            if storage.nbytes():
                by_address.setdefault(storage.data_ptr(), []).append(key)
        if by_address and len(by_address) == len(data):
            base = min(by_address) - min(data)
            found = {address: data.get(address - base) for address in by_address}
            if all(rec is not None and rec.size == self._tensors[by_address[address][0]].untyped_storage().nbytes()
                   for address, rec in found.items()):
                for address, rec in found.items():
                    assert rec is not None
                    self._data_at[rec.name] = address - base
                    self._record_of.update((key, rec) for key in by_address[address])
                return
        for rec in data.values():
            self._check(rec, url)

    def _check(self, rec: ZipRecord, where: str) -> None:
        self._checked.ensure(rec.name, lambda: check_record(self._file, self._name, 0, self._size, rec, where,
                                                            data_at=self._data_at.get(rec.name)))

    def tensors(self) -> Mapping[str, TensorEntry]:
        return self._entries

    def values(self) -> Mapping[str, Any]:
        return self._values

    def read(self, requests: Sequence[ReadRequest]) -> None:
        self._check_requests(requests)
        for r in requests:  # every record the requests need is checked before any out is written
            rec = self._record_of.get(r.fqn)
            if rec is not None:
                self._check(rec, f"{self.info.url} [{r.fqn}]")
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
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
            self._tmp = None


# --------------------------------------------------------------------------
# writing: data.pkl by hand (formats/pickle_ops.py), storage records streamed in row blocks


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


