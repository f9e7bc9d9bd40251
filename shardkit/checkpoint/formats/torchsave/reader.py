"""torch.save files (``.pt``/``.bin``): read with mmap, write tensor by tensor.

Reading uses ``torch.load(weights_only=True, mmap=True)``: tensors stay backed
by the file, so only the rows being converted are paged in.  A remote file is
first copied to a local temporary file (disk, not memory) so it can be mapped.
torch.load checks no CRC-32, so the reader checks each zip record's before
serving its bytes (:mod:`.zip_records`).  A file that needs classes outside
the ``weights_only`` allowlist is refused, naming the class, unless the user
trusts it (``trust_pickle``, :class:`TorchLoadOptions`).  What the unpickled
object means as a state dict (classic ``{"model", "optimizer"}`` files,
optimizer state keyed by parameter number) is :mod:`.state`'s concern.

Writing does not call ``torch.save`` on a state dict, which would need the
whole dict in memory.  A torch.save file is a zip archive: a small
``data.pkl`` that rebuilds every tensor from named storages, plus one stored
(uncompressed) record per storage.  We emit ``data.pkl`` directly as a short
sequence of pickle protocol-2 opcodes (:mod:`~shardkit.checkpoint.formats.pickle_ops`: dicts, strings,
numbers and the same ``_rebuild_tensor_v2`` calls ``torch.save`` emits — all on
the allowlist of ``torch.load(weights_only=True)``), then stream each storage
record in row blocks, 64-byte aligned like torch's own writer so ``mmap=True``
works.  Memory is one row block, whatever the model size.  DCP payloads are
the same archives (:func:`write_archive`), one per chunk.
"""

from __future__ import annotations

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
from shardkit.checkpoint.formats.torchsave.mapped import MappedTorchFile
from shardkit.checkpoint.formats.torchsave.state import flatten_state
from shardkit.checkpoint.geometry.rows import copy_box
from shardkit.checkpoint.io.storage import Storage, split_file
from shardkit.checkpoint.state.tree import object_path
from shardkit.errors import CheckpointNotFound

__all__ = ["TorchSaveReader", "TorchLoadOptions", "detect", "open_reader", "value_path", "STORAGE_TYPES"]


STORAGE_TYPES = {
    torch.float32: "FloatStorage", torch.float64: "DoubleStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage",
}
_ALIGN = 64
_ARCHIVE = "archive"


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
    (:class:`.mapped.MappedTorchFile`): ``data.pkl`` and the other small
    records at open, each tensor's storage record the first time one of its
    rows is read.
    """

    def __init__(self, storage: Storage, options: TorchLoadOptions | None = None) -> None:
        super().__init__()
        opts = options or TorchLoadOptions()
        self._tensors: dict[str, torch.Tensor] = {}
        self.skipped_side_files: list[str] = []  # what a trusted file held that no checkpoint can (notes)
        url = storage.url
        self._file = MappedTorchFile(storage, trust_pickle=opts.trust_pickle, unsafe_hint=(
            "if you trust this file, pass --trust-pickle (trust_pickle=True in Python; unsafe on untrusted files)"))
        try:
            state = flatten_state(self._file.obj, url, model_keys=opts.model_keys, need_names=opts.need_names,
                                  trusted=opts.trust_pickle)
            self._tensors, self._values, self.skipped_side_files = state.tensors, state.values, state.notes
            self._file.map_tensors(self._tensors.values())
        except BaseException:
            self.close()
            raise
        self._entries = {k: TensorEntry(k, t.dtype, tuple(t.shape), (StoredChunk((0,) * t.dim(), tuple(t.shape), k),))
                         for k, t in self._tensors.items()}
        self.info = CheckpointInfo("torch", url)

    def tensors(self) -> Mapping[str, TensorEntry]:
        return self._entries

    def values(self) -> Mapping[str, Any]:
        return self._values

    def read(self, requests: Sequence[ReadRequest]) -> None:
        self.check_requests(requests)
        for r in requests:  # every record the requests need is checked before any out is written
            self._file.ensure_checked(self._tensors[r.fqn], f"{self.info.url} [{r.fqn}]")
        for r in requests:
            rows = copy_box(self._tensors[r.fqn], self._entries[r.fqn].chunks[0].offsets, r.box, r.out)
            self._file.release(rows)
            self.stats.add(read=r.out.numel() * r.out.element_size(), requests=1)

    def close(self) -> None:
        self._tensors = {}
        self._file.close()


# --------------------------------------------------------------------------
# writing: data.pkl by hand (formats/pickle_ops.py), storage records streamed in row blocks


