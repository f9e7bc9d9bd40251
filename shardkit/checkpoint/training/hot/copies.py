"""One rank's shards as a small native checkpoint of its own: the unit the hot tier writes, sends and reads.

A copy holds the rank's *local* tensors (each DTensor's local shard, each plain tensor whole) under the
state dict's flattened keys, plus the state's JSON values, written by this rank alone
(:meth:`~shardkit.checkpoint.io.dist.Dist.alone`: no collective) with the format's checksums.  Its
manifest's ``meta["hot"]`` says which step, save and rank it is, and the *structure* -- a digest of every
key's dtype, local shape, global shape and placements -- so a copy is only ever loaded into the very
layout that wrote it (a job restarted on another mesh goes to the durable root instead).

Reading is in two phases, like ``load``: :func:`check_copy` reads and checks every byte (nothing written
yet), the ranks agree, then :meth:`CheckedCopy.apply` writes the targets.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from shardkit.checkpoint.formats import NATIVE, open_reader
from shardkit.checkpoint.formats.native import DEFAULT_BLOCK_BYTES, DEFAULT_CHUNK_BYTES, MANIFEST_NAME
from shardkit.checkpoint.geometry.boxes import is_dtensor, local_tensor
from shardkit.checkpoint.io.concurrency import DEFAULT_IO_THREADS
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.tree import Flat, flatten, from_json_value
from shardkit.checkpoint.training.device_reads import read_requests
from shardkit.checkpoint.training.input_state import INPUT_KEYS
from shardkit.checkpoint.training.load import Checked, check_before_writing, default_staging_bytes, plan_load
from shardkit.checkpoint.training.save import plan_save, write_and_commit
from shardkit.checkpoint.training.save_options import SaveOptions
from shardkit.errors import CorruptCheckpoint

__all__ = ["LocalState", "local_state", "structure_of", "write_copy", "copy_meta", "check_copy", "CheckedCopy",
           "HostCopy"]

_INPUT_PREFIXES = tuple(f"{k}." for k in INPUT_KEYS)


@dataclass
class LocalState:
    """A state dict as this rank holds it: local tensors by flattened key, the JSON values, the structure."""

    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    structure: str
    flat: Flat

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def local_state(state: dict[str, Any]) -> LocalState:
    """Flatten ``state`` and take each tensor's local shard (no copy)."""
    flat = flatten(state)
    tensors = {key: local_tensor(t).detach() for key, t in flat.tensors.items()}
    return LocalState(tensors, flat.values, structure_of(flat.tensors), flat)


def structure_of(tensors: Mapping[str, torch.Tensor]) -> str:
    """A digest of the layout of the model and optimizer tensors among ``tensors`` (flattened keys): each
    key's dtype, local and global shape, placements and mesh shape.  Input state (``data.*``, ``rng.*``) is
    left out: a resume learns it from the copy itself."""
    described = [[key, str(t.dtype), list(local_tensor(t).shape), list(t.shape),
                  [str(p) for p in t.placements] if is_dtensor(t) else None,
                  list(t.device_mesh.shape) if is_dtensor(t) else None]
                 for key, t in sorted(tensors.items()) if not key.startswith(_INPUT_PREFIXES)]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:32]


def write_copy(url: str, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any], hot: Mapping[str, Any],
               meta: Mapping[str, Any]) -> int:
    """Write ``tensors`` (host or device memory) and ``values`` as a native checkpoint at ``url`` by this rank
    alone; ``meta["hot"] = hot``.  Returns the bytes written.  Raises what ``save`` raises."""
    alone = Dist.alone()
    state = {**tensors, **{key: from_json_value(v) for key, v in values.items()}}  # flattened again: the same keys
    plan = plan_save(state, alone, chunk_bytes=DEFAULT_CHUNK_BYTES, io_threads=DEFAULT_IO_THREADS, compression=None)
    storage = Storage(url)
    storage.makedirs()
    write_and_commit(storage, plan, None, alone, SaveOptions(meta={**meta, "hot": dict(hot)}, overwrite=False,
                                                             block_bytes=DEFAULT_BLOCK_BYTES,
                                                             io_threads=DEFAULT_IO_THREADS))
    return plan.nbytes


def copy_meta(url: str) -> dict[str, Any]:
    """The ``meta`` of the copy at ``url`` (its manifest only: cheap).  Raises
    :class:`~shardkit.errors.CorruptCheckpoint` when the manifest is missing, unreadable or not a hot copy's."""
    try:
        raw = Storage(url).read_bytes(MANIFEST_NAME)
        meta = json.loads(raw.decode("utf-8")).get("meta")
        hot = meta["hot"]
        if not isinstance(hot, dict) or not {"step", "save_id", "rank", "world_size", "structure"} <= set(hot):
            raise KeyError("hot")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpoint(f"{url}/{MANIFEST_NAME}: not a readable hot-tier copy ({type(exc).__name__}: "
                                f"{exc})") from None
    return meta


@dataclass
class CheckedCopy:
    """A copy whose bytes were all read and checked; :meth:`apply` writes the targets."""

    checked: Checked
    reader: Any
    flat: Flat
    meta: dict[str, Any]

    def apply(self) -> None:
        """Write every target: staged bytes, then in-place reads (checked already), then the values."""
        try:
            for out, buf in self.checked.staged:
                out.copy_(buf)
            self.checked.staged.clear()
            read_requests(self.reader, self.checked.in_place)  # a GPU target through small page-locked rounds
            values = self.reader.values()
            for key in self.flat.values:
                if key in values:
                    self.flat.set_value(key, from_json_value(values[key]))
        finally:
            self.reader.close()

    def discard(self) -> None:
        self.checked.staged.clear()
        self.reader.close()


def check_copy(url: str, state: dict[str, Any], structure: str) -> CheckedCopy:
    """Read and check (checksums, sizes, keys, shapes) everything the copy at ``url`` holds for ``state``
    (this rank's local tensors become the targets), writing nothing.  Raises
    :class:`~shardkit.errors.CorruptCheckpoint` for damage and for a copy of another layout."""
    meta = copy_meta(url)
    if meta["hot"]["structure"] != structure:
        raise CorruptCheckpoint(f"{url} was written for another layout of the state (its structure "
                                f"{meta['hot']['structure']}, this rank's {structure})")
    flat = flatten(state)
    local = Flat({key: local_tensor(t) for key, t in flat.tensors.items()}, flat.values, flat.slots)
    reader = open_reader(url, format=NATIVE.name, io_threads=DEFAULT_IO_THREADS)
    try:
        plan = plan_load(reader, local, strict=True)
        reader.prepare(plan.requests)
        checked = check_before_writing(reader, plan.requests, default_staging_bytes())
    except BaseException:
        reader.close()
        raise
    return CheckedCopy(checked, reader, flat, meta)


class HostCopy:
    """Reused host buffers for one rank's local tensors: what an asynchronous hot save copies the state into
    before training goes on (page-locked when the state is on a GPU).  The buffers are kept from save to save
    while the structure stays, so a repeat save is a plain copy into memory already mapped."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._shapes: list[tuple] | None = None

    def copy(self, state: LocalState) -> dict[str, torch.Tensor]:
        shapes = [(key, t.shape, t.dtype, t.device.type) for key, t in state.tensors.items()]  # input state too
        if shapes != self._shapes:
            self._buffers = {key: torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                              pin_memory=t.is_cuda and torch.cuda.is_available())
                             for key, t in state.tensors.items()}
            self._shapes = shapes
        on_gpu = False
        for key, t in state.tensors.items():
            self._buffers[key].copy_(t, non_blocking=t.is_cuda)
            on_gpu = on_gpu or t.is_cuda
        if on_gpu:
            torch.cuda.current_stream().synchronize()
        return dict(self._buffers)
