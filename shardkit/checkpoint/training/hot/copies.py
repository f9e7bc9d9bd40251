"""One rank's shards as a copy of its own: the unit the hot tier writes, sends and reads.

A copy holds the rank's *local* tensors (each DTensor's local shard, each plain tensor whole) under the
state dict's flattened keys, plus the state's JSON values, written by this rank alone as one data file and
a manifest (:mod:`.flat`: checksummed, published atomically).  Its manifest's ``meta["hot"]`` says which
step, save and rank it is, and the *structure* -- a digest of every key's dtype, local shape, global shape
and placements -- so a copy is only ever loaded into the very layout that wrote it (a job restarted on
another mesh goes to the durable root instead).

On the training thread a save only takes the state: the model's and optimizer's local tensors and values
(:func:`local_state`), and the input state (``data``, ``rng``) as :func:`~shardkit.data.data_state_dict`
returned it -- a snapshot already, flattened by the writer in the background -- or, for a step that goes
to the hot tier alone, only this rank's RNG state, gathered over the ranks by the background save
(:class:`~shardkit.data.resume.InputSnapshot`).

Reading is in two phases, like ``load``: :func:`check_copy` checks a copy against the targets (nothing
written yet), the ranks agree, then :meth:`CheckedCopy.apply` writes the targets.  A copy read and checked
whole before (a :class:`~.flat.FlatCopy`: a peer's, received) is copied into them; a rank's own copy on its
node (a :class:`~.flat.PendingCopy`, its input state read already) is read straight into them, every byte
checked as it lands -- then a damaged byte is found after targets were written, which the recovery treats
as such (:mod:`.recover`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from shardkit.checkpoint.geometry.boxes import is_dtensor, local_tensor
from shardkit.checkpoint.io.local_files import release_in_background
from shardkit.checkpoint.state.tree import Flat, flatten, from_json_value
from shardkit.checkpoint.training.hot.flat import FlatCopy, PendingCopy, read_manifest, write_flat
from shardkit.checkpoint.training.input_state import INPUT_KEYS
from shardkit.data import nest
from shardkit.errors import CorruptCheckpoint

__all__ = ["LocalState", "local_state", "structure_of", "write_copy", "copy_meta", "checked_meta", "check_copy",
           "CheckedCopy", "HostCopy", "input_targets", "is_input_key"]

_INPUT_PREFIXES = tuple(f"{k}." for k in INPUT_KEYS)
_HOT_FIELDS = {"step", "save_id", "rank", "world_size", "structure"}


@dataclass
class LocalState:
    """A state dict as this rank holds it: the model's and optimizer's local tensors by flattened key, their
    JSON values, the structure, and the input state (``data``/``rng``, nested, a snapshot)."""

    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    structure: str
    flat: Flat
    inputs: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def local_state(state: dict[str, Any]) -> LocalState:
    """Flatten the model and optimizer part of ``state`` and take each tensor's local shard (no copy); the
    input state is kept as it is (the writer flattens it)."""
    flat = flatten({k: v for k, v in state.items() if k not in INPUT_KEYS})
    tensors = {key: local_tensor(t) for key, t in flat.tensors.items()}
    inputs = {k: v for k, v in state.items() if k in INPUT_KEYS}
    return LocalState(tensors, flat.values, structure_of(flat.tensors), flat, inputs)


_structures: dict[tuple, str] = {}  # the digest of the last layouts seen (a save every step: the same one)


def structure_of(tensors: Mapping[str, torch.Tensor]) -> str:
    """A digest of the layout of the model and optimizer tensors among ``tensors`` (flattened keys): each
    key's dtype, local and global shape, placements and mesh shape.  Input state (``data.*``, ``rng.*``) is
    left out: a resume learns it from the copy itself.  Cached by the layout itself (cheap to compare; the
    digest's text is not cheap to build every step)."""
    meshes: dict[int, tuple[int, ...]] = {}  # a mesh's shape is slow to ask for; a model has one or two meshes

    def mesh_shape(mesh: Any) -> tuple[int, ...]:
        found = meshes.get(id(mesh))
        if found is None:
            found = meshes[id(mesh)] = tuple(mesh.shape)
        return found

    layout = tuple((key, t.dtype, tuple(local_tensor(t).shape), tuple(t.shape),
                    tuple(t.placements) if is_dtensor(t) else None,
                    mesh_shape(t.device_mesh) if is_dtensor(t) else None)
                   for key, t in sorted(tensors.items()) if not key.startswith(_INPUT_PREFIXES))
    found = _structures.get(layout)
    if found is None:
        described = [[key, str(dtype), list(local), list(shape), [str(p) for p in placements]
                      if placements is not None else None, list(mesh) if mesh is not None else None]
                     for key, dtype, local, shape, placements, mesh in layout]
        found = hashlib.sha256(json.dumps(described).encode()).hexdigest()[:32]
        if len(_structures) > 8:
            _structures.clear()
        _structures[layout] = found
    return found


def write_copy(url: str, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any], inputs: Mapping[str, Any],
               hot: Mapping[str, Any], meta: Mapping[str, Any]) -> int:
    """Write ``tensors`` (host memory), ``values`` (JSON-encoded) and the input state ``inputs`` (nested) as a
    copy at ``url`` by this rank alone; ``meta["hot"] = hot``.  Returns the bytes written."""
    flat_inputs = flatten(dict(inputs))
    host = {key: t.to("cpu") for key, t in {**tensors, **flat_inputs.tensors}.items()}
    return write_flat(url, host, {**values, **flat_inputs.values}, {**meta, "hot": dict(hot)})


def copy_meta(url: str) -> dict[str, Any]:
    """The ``meta`` of the copy at ``url`` (its manifest only: cheap).  Raises
    :class:`~shardkit.errors.CorruptCheckpoint` when the manifest is missing, unreadable or not a hot copy's."""
    return checked_meta(read_manifest(url)["meta"], url)


def checked_meta(meta: dict[str, Any], url: str) -> dict[str, Any]:
    """``meta`` (of the copy at ``url``, read or received) when it names the hot-tier step, save and rank.
    Raises :class:`~shardkit.errors.CorruptCheckpoint` when it does not."""
    hot = meta.get("hot")
    if not isinstance(hot, dict) or not _HOT_FIELDS <= set(hot):
        raise CorruptCheckpoint(f"{url}: its manifest names no hot-tier step, save and rank")
    return meta


def is_input_key(key: str) -> bool:
    """Whether a copy's flattened ``key`` is input state (``data.*``, ``rng.*``), not model or optimizer."""
    return key.startswith(_INPUT_PREFIXES)


def input_targets(copy: FlatCopy | PendingCopy) -> dict[str, Any]:
    """The input state (``data``, ``rng``) the copy holds, nested, as a load fills it: its tensors (each its
    own small tensor: an RNG state is handed to torch, which reads its storage from the start -- a pending
    copy's are that already, and a peer's are filled in place when its bytes arrive) and its values
    decoded."""
    found = {key: from_json_value(v) for key, v in copy.values.items() if key.startswith(_INPUT_PREFIXES)}
    found.update({key: t if isinstance(copy, PendingCopy) else t.clone()
                  for key, t in copy.tensors.items() if key.startswith(_INPUT_PREFIXES)})
    return nest(found)


@dataclass
class CheckedCopy:
    """A copy checked against the targets (keys, dtypes, shapes); :meth:`apply` writes them."""

    copy: FlatCopy | PendingCopy
    targets: dict[str, torch.Tensor]
    flat: Flat
    filled: bool = False  # a pending copy's tensors were read into the targets (by :meth:`fill`)
    fill_error: Exception | None = None  # what an early :meth:`fill` raised, raised again by the next

    @property
    def meta(self) -> dict[str, Any]:
        return self.copy.meta

    @property
    def pending(self) -> bool:
        """Whether the copy's bytes are still to be read (and checked) as :meth:`apply` writes them."""
        return isinstance(self.copy, PendingCopy)

    def fill(self) -> None:
        """A pending copy's tensors read straight into the targets, checked as they land: raises
        :class:`~shardkit.errors.CorruptCheckpoint` for a damaged byte, with targets written.  Nothing to do
        for a copy read whole before."""
        if self.fill_error is not None:
            raise self.fill_error
        if isinstance(self.copy, PendingCopy) and not self.filled:
            try:
                self.copy.fill(self.targets)
            except Exception as exc:
                self.fill_error = exc
                raise
            self.filled = True

    def apply(self) -> None:
        """Write every target tensor (unless :meth:`fill` did) and value from the checked bytes."""
        if isinstance(self.copy, PendingCopy):
            if not self.filled:
                self.copy.fill(self.targets)
        else:
            with torch.no_grad():
                for key, target in self.targets.items():
                    target.copy_(self.copy.tensors[key])
        for key in self.flat.values:
            if key in self.copy.values:
                self.flat.set_value(key, from_json_value(self.copy.values[key]))
        self.discard()

    def discard(self) -> None:
        """Let go of the copy's bytes: a read copy's mapping (or buffer) is released off this thread; a pending
        copy holds only its input state's few small tensors (its bytes went straight into the targets), let
        go of here -- starting a thread for them cost more than they do (up to tens of ms on a busy machine,
        where the new thread must be scheduled before ``start`` returns)."""
        held = list(self.copy.tensors.values())
        self.copy.tensors.clear()
        self.targets.clear()
        if not isinstance(self.copy, PendingCopy):
            release_in_background(held)


def check_copy(copy: FlatCopy | PendingCopy, flat: Flat, structure: str) -> CheckedCopy:
    """Check that ``copy`` (read and checksummed, or pending) holds exactly the model and optimizer state ``flat``
    (flattened; its tensors' local shards become the targets) with this rank's local dtypes and shapes, and
    its values; nothing is written.  The copy's input state (``data.*``, ``rng.*``) is not a target here:
    :func:`input_targets` hands it over as it is.  Raises :class:`~shardkit.errors.CorruptCheckpoint` for a
    copy of another layout or with keys missing or extra."""
    if copy.meta["hot"]["structure"] != structure:
        raise CorruptCheckpoint(f"{copy.path} was written for another layout of the state (its structure "
                                f"{copy.meta['hot']['structure']}, this rank's {structure})")
    targets = {key: local_tensor(t) for key, t in flat.tensors.items()}
    layouts = ({key: (e.dtype, torch.Size(e.shape)) for key, e in copy.entries.items()}
               if isinstance(copy, PendingCopy) else {key: (t.dtype, t.shape) for key, t in copy.tensors.items()})
    held = {key for key in layouts if not key.startswith(_INPUT_PREFIXES)}
    missing = sorted(set(targets) - held) + sorted(set(flat.values) - set(copy.values))
    extra = sorted(held - set(targets))
    if missing or extra:
        raise CorruptCheckpoint(f"{copy.path} does not hold this rank's state: missing {missing[:3]}, "
                                f"unexpected {extra[:3]}")
    for key, target in targets.items():
        dtype, shape = layouts[key]
        if dtype != target.dtype or shape != target.shape:
            raise CorruptCheckpoint(f"{copy.path}: {key!r} is {dtype} {list(shape)} there, "
                                    f"{target.dtype} {list(target.shape)} in this rank's state")
    return CheckedCopy(copy, targets, flat)


class HostCopy:
    """Reused host buffers for one rank's local tensors: what an asynchronous hot save copies the state into
    before training goes on (page-locked when the state is on a GPU).  The buffers are kept from save to save
    while the structure stays, so a repeat save is a plain copy into memory already mapped."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._shapes: list[tuple] | None = None

    def copy(self, state: LocalState) -> dict[str, torch.Tensor]:
        shapes = [(key, t.shape, t.dtype, t.device.type) for key, t in state.tensors.items()]
        if shapes != self._shapes:
            self._buffers = {key: torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                              pin_memory=t.is_cuda and torch.cuda.is_available())
                             for key, t in state.tensors.items()}
            self._shapes = shapes
        on_gpu = False
        with torch.no_grad():
            for key, t in state.tensors.items():
                self._buffers[key].copy_(t, non_blocking=t.is_cuda)
                on_gpu = on_gpu or t.is_cuda
        if on_gpu:
            torch.cuda.current_stream().synchronize()
        return dict(self._buffers)
