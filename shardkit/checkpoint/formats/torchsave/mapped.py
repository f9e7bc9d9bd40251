"""One torch.save file opened the way every shardkit reader of pickled checkpoints opens it.

``torch.load(weights_only=True, mmap=True)``: nothing outside torch's
allowlist (plus the inert stand-ins a format names, ``safe_globals``) is
rebuilt, and tensors stay backed by the file, so only the rows a conversion
copies are paged in.  A remote file is spooled to a local temporary file
(disk, not memory) so it can be mapped.  torch.load checks no CRC-32, so the
small records (``data.pkl``) are checked before anything is unpickled from
them and each storage record the first time one of its tensors is read
(:mod:`.zip_records`).  The torch.save reader and the DeepSpeed reader both
open their files through :class:`MappedTorchFile`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import tempfile
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from shardkit.checkpoint.formats.torchsave.zip_records import (
    CheckedOnce,
    ZipRecord,
    carries_checksums,
    check_record,
    data_start,
    list_records,
)
from shardkit.checkpoint.io.storage import Storage, split_file
from shardkit.errors import InvalidManifest, ShardkitError, UnsafeCheckpoint

__all__ = ["MappedTorchFile", "refusal", "tensors_in"]

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch's refusal message carries terminal bold codes


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


@contextlib.contextmanager
def _quiet_mesh_unpickling() -> Iterator[None]:
    """Silence torch's warning that an unpickled ``DeviceMesh`` finds none of its process groups: a file read
    offline always holds the mesh of a job that is gone, and only its shape and placements are used here."""
    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    previous = mesh_log.level
    mesh_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        mesh_log.setLevel(previous)


def _unpickle(path: str, trust_pickle: bool, safe_globals: Sequence[tuple[Callable, str]]) -> Any:
    """``torch.load`` of the mapped file.  torch allowlists ``DTensor`` (its mesh and placements) for
    ``weights_only`` loads once ``torch.distributed.tensor`` is imported; that import is slow, so it is made
    only for a file that turns out to hold DTensors (a sharded job's per-rank ``torch.save``)."""
    for attempt in range(2):
        with torch.serialization.safe_globals(list(safe_globals)), _quiet_mesh_unpickling():
            try:
                return torch.load(path, map_location="cpu", weights_only=not trust_pickle, mmap=True)
            except Exception as exc:  # noqa: BLE001 - the caller reports what torch refused
                if attempt or trust_pickle or "torch.distributed.tensor`` must be imported" not in str(exc):
                    raise
        importlib.import_module("torch.distributed.tensor")  # registers DTensor on the weights_only allowlist
    raise AssertionError("unreachable")


class MappedTorchFile:
    """A torch.save file, unpickled under an allowlist and memory-mapped.

    ``safe_globals``: ``(stand_in, "module.Name")`` pairs, so a class the
    file names is rebuilt as an inert stand-in instead of being imported.
    ``unsafe_hint``: what to tell a user whose file names a class outside the
    allowlist (the refusal always names the class).  ``trust_pickle``: no
    allowlist at all (the torch.save reader's opt-in).  :attr:`obj` is what
    the file holds; call :meth:`map_tensors` with the tensors that will be
    read, then :meth:`ensure_checked` before serving any of their bytes.
    """

    def __init__(self, storage: Storage, *, unsafe_hint: str, trust_pickle: bool = False,
                 safe_globals: Sequence[tuple[Callable, str]] = ()) -> None:
        self.url = storage.url
        self._tmp: str | None = None
        self._checked = CheckedOnce()
        self._record_at: dict[int, ZipRecord] = {}   # storage address -> its record
        self._data_at: dict[str, int] = {}
        self._records: list[ZipRecord] = []
        self._mapping: tuple[int, int] | None = None  # [start, end) address of the file's mapping, once known
        try:
            self._file, self._name, path = self._local_file(storage)
            self._size = self._file.size(self._name)
            self._records = list_records(self._file, self._name, 0, self._size, self.url)
            self._crc = carries_checksums(self._records)
            if self._crc:  # data.pkl and the other small records, before anything is unpickled from them
                for rec in self._records:
                    if "/data/" not in rec.name:
                        self._check(rec, self.url)
            else:
                log.warning("%s: written without CRC-32s (torch's save.compute_crc32=False); its bytes cannot be "
                            "checked", self.url)
            if trust_pickle:
                log.warning("%s: unpickling with trust_pickle=True: the weights_only allowlist is off and any "
                            "code the file names runs; use this only on files you trust", self.url)
            self.obj: Any = _unpickle(path, trust_pickle, safe_globals)
        except BaseException as exc:
            self.close()  # a failed download, a bad file or unreadable contents leave no spool file behind
            if isinstance(exc, ShardkitError) or not isinstance(exc, Exception):
                raise
            refused = refusal(exc)
            if refused and not trust_pickle:
                raise UnsafeCheckpoint(f"{self.url}: refusing to unpickle it: {refused}, and loading it could run "
                                       f"code the file names; {unsafe_hint}") from None
            msg = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise InvalidManifest(f"{self.url}: not a readable torch.save file ({msg})") from None

    def _local_file(self, storage: Storage) -> tuple[Storage, str, str]:
        """(folder, name, path) of the file on local disk; a remote file is spooled to a temporary file
        first so it can be mapped."""
        parent, name = split_file(storage)
        if parent.maps_files:
            return parent, name, parent.path(name)
        fd, self._tmp = tempfile.mkstemp(suffix=".pt", prefix="shardkit-")
        os.close(fd)
        tmp = self._tmp
        parent.download(name, tmp)
        return Storage(os.path.dirname(tmp)), os.path.basename(tmp), tmp

    def map_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Find the storage record holding each tensor's bytes, so each is checked when first read.

        ``mmap=True`` maps the whole file once and makes each storage a slice
        of that mapping starting at its record's bytes, so the storages'
        addresses minus the records' data offsets are one constant: the
        mapping's address.  When the non-empty storages and records pair up
        one to one under that constant (sizes agreeing), each tensor's record
        is known, and so is the mapping (for :meth:`release`); anything else
        (a torch that maps otherwise, tensors left out) tells us nothing, and
        then every record is checked now, before any byte is served.
        """
        data = {data_start(self._file, self._name, 0, r, self.url): r
                for r in self._records if "/data/" in r.name and r.size}
        sizes: dict[int, int] = {}
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes():
                sizes[storage.data_ptr()] = storage.nbytes()
        if sizes and len(sizes) == len(data):
            base = min(sizes) - min(data)
            found = {address: data.get(address - base) for address in sizes}
            if all(rec is not None and rec.size == sizes[address] for address, rec in found.items()):
                self._mapping = (base, base + self._size)
                for address, rec in found.items():
                    assert rec is not None
                    self._data_at[rec.name] = address - base
                    self._record_at[address] = rec
                return
        if self._crc:
            for rec in data.values():
                self._check(rec, self.url)

    def release(self, view: torch.Tensor) -> None:
        """Drop the file pages ``view`` (a view of this file's mapping, just copied from) from this process's
        RSS (``MADV_DONTNEED``); the mapping is private and unmodified, so a later read faults them in again.
        Anything not inside the mapping (a copy on the heap, whose pages this would zero) is left alone."""
        n = view.numel() * view.element_size()
        if self._mapping is None or n < (1 << 20) or not view.is_contiguous():
            return
        lo, hi = view.data_ptr(), view.data_ptr() + n
        if self._mapping[0] <= lo and hi <= self._mapping[1]:
            _madvise_dontneed(lo, hi)

    def ensure_checked(self, tensor: torch.Tensor, where: str) -> None:
        """Check the record behind ``tensor`` (once) before any of its bytes is served."""
        storage = tensor.untyped_storage()
        rec = self._record_at.get(storage.data_ptr()) if storage.nbytes() and self._crc else None
        if rec is not None:
            self._check(rec, where)

    def _check(self, rec: ZipRecord, where: str) -> None:
        self._checked.ensure(rec.name, lambda: check_record(self._file, self._name, 0, self._size, rec, where,
                                                            data_at=self._data_at.get(rec.name)))

    def close(self) -> None:
        self.obj = None
        if self._tmp:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
            self._tmp = None


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in an unpickled object (dicts, lists, tuples, and the fields of allowlisted objects)."""
    found: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            stack.extend(vars(value).values())
    return found


def _madvise_dontneed(lo: int, hi: int) -> None:
    try:
        import ctypes
        import mmap

        page = mmap.PAGESIZE
        lo = -(-lo // page) * page
        hi = hi // page * page
        if hi > lo:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED
    except (OSError, AttributeError, ValueError):
        pass
