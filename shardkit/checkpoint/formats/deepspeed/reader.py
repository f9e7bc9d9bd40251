"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3): read parameter by parameter, in bounded memory.

A DeepSpeed checkpoint directory holds ``latest`` (the newest tag) and one
folder per tag (``global_step100/``) with ``*_model_states.pt`` (the module's
state dict and every parameter's shape) and one ``*_optim_states.pt`` per
data-parallel rank (that rank's flat fp32 master partition and the optimizer
state of the same shape).  SRC may be the directory (its ``latest`` tag is
read) or a tag folder; :mod:`.files` finds the files and checks that they
make one save.

What the reader serves, keyed as shardkit keys a model and its optimizer:

* ``model.<name>``: each trainable parameter in fp32, from the master
  partitions (:mod:`.layout` says where its elements lie); frozen parameters
  and buffers from the model-state files; tied parameters as aliases;
* ``optim.state.<name>.<key>``: every optimizer state tensor the ZeRO
  optimizer keeps per element (Adam's ``exp_avg``/``exp_avg_sq``, or
  whatever another optimizer keeps, under its own key), cut per parameter the
  same way, and per-group scalars (``step``) given to each parameter;
* ``optim.param_groups``: the hyperparameters, with each group's parameters
  named; ``lr_scheduler.*``: the scheduler's state, when it is plain data.

Every file is opened with :class:`~shardkit.checkpoint.formats.torchsave.mapped.MappedTorchFile`:
memory-mapped, each zip record CRC-checked before use, and unpickled by
torch's allowlisting unpickler extended only by :mod:`.allowlist`.  Nothing
is gathered: a read copies the elements of the rows it asks for, partition
by partition, so memory is what the caller asks for, not a flat group.
Model-parallel (``mp_rank_01``) and pipeline (``layer_*``) checkpoints are
refused, naming the file.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import CheckpointInfo, CheckpointReader, ReadRequest, StoredChunk, TensorEntry
from shardkit.checkpoint.formats.deepspeed.allowlist import ALLOWED_CLASSES, SAFE_GLOBALS
from shardkit.checkpoint.formats.deepspeed.files import (
    MODEL_STATES,
    check_model_states,
    optimizer_state_dicts,
    state_files,
    tag_folder,
    world_size,
)
from shardkit.checkpoint.formats.deepspeed.layout import (
    Piece,
    cut,
    spread_pieces,
    starts_of,
    zero3_pieces,
    zero12_pieces,
)
from shardkit.checkpoint.formats.hf.reader import side_files_in
from shardkit.checkpoint.formats.torchsave.mapped import MappedTorchFile, tensors_in
from shardkit.checkpoint.geometry.rows import copy_rows_into, row_range
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.tree import plain_values, to_json_value
from shardkit.errors import ConfigurationError, InvalidManifest, ShardkitError, UnsupportedFormat

__all__ = ["DeepSpeedReader", "detect", "open_reader"]

_HINT = ("shardkit reads DeepSpeed's own classes (" + ", ".join(sorted(ALLOWED_CLASSES)) + ") as data and no "
         "other; a file naming anything else is not a checkpoint DeepSpeed's ZeRO writes by itself")


def detect(storage: Storage) -> bool:
    """A folder with ``*_model_states.pt``, or one whose ``latest`` names such a folder."""
    try:
        if not storage.is_dir():
            return False
        folder, _ = tag_folder(storage)
        return any(MODEL_STATES.match(n) for n in folder.listdir())
    except (ShardkitError, OSError, UnicodeError):
        return False


def open_reader(storage: Storage) -> "DeepSpeedReader":
    return DeepSpeedReader(storage)


class DeepSpeedReader(CheckpointReader):
    """A ZeRO checkpoint; see the module docstring."""

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self._files: list[MappedTorchFile] = []
        self._entries: dict[str, TensorEntry] = {}
        self._values: dict[str, Any] = {}
        self._aliases: dict[str, str] = {}
        self.skipped_side_files: list[str] = []
        try:
            self._open(storage)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ opening
    def _open(self, storage: Storage) -> None:
        folder, tag = tag_folder(storage)
        self.tag_folder = folder
        # config.json and tokenizer files beside the tag folders (a Trainer's checkpoint-N/), for --to hf
        self.folder, self.side_files = storage, (side_files_in(storage)[0] if tag is not None else [])
        model_names, optim_names = state_files(folder)
        self.file_names = model_names + optim_names
        models = [self._load(folder, n) for n in model_names]
        optims = [self._load(folder, n) for n in optim_names]
        model = models[0]
        check_model_states(folder, model_names, models)
        where = folder.url
        sd = optimizer_state_dicts(folder, optim_names, optims)
        stage = int(sd[0].get("zero_stage", 1)) if sd else 0
        world = world_size(sd, optim_names, folder)
        shapes = model.get("param_shapes") or []
        groups = [{str(k): tuple(int(x) for x in v) for k, v in g.items()} for g in shapes]
        self._module(model)
        if stage == 0 or not sd:
            self.skipped_side_files.append("the optimizer state of a ZeRO stage-0 checkpoint (not partitioned; "
                                           "convert the model)")
            self._full_params(model)
        elif stage in (1, 2):
            self._zero12(sd, groups, models, where)
        elif stage == 3:
            self._zero3(sd, groups, models, where)
        else:
            raise UnsupportedFormat(f"{where}: ZeRO stage {stage} is unknown")
        self._module_leftovers(model, groups)
        for alias, target in (model.get("shared_params") or {}).items():
            if f"model.{target}" in self._entries:
                self._aliases[f"model.{alias}"] = f"model.{target}"
                self._entries[f"model.{alias}"] = self._entries[f"model.{target}"]
        self._scheduler(model.get("lr_scheduler"))
        meta = {"step": model.get("global_steps"), "zero_stage": stage, "tag": tag,
                "deepspeed_version": model.get("ds_version")}
        self.info = CheckpointInfo("deepspeed", storage.url, world_size=world,
                                   meta={k: v for k, v in meta.items() if v is not None})

    def _load(self, folder: Storage, name: str) -> Any:
        f = MappedTorchFile(folder.child(name), unsafe_hint=_HINT, safe_globals=SAFE_GLOBALS)
        self._files.append(f)
        f.map_tensors(tensors_in(f.obj))  # each record is checked the first time a tensor of it is read
        return f.obj

    # -------------------------------------------------------------- entries
    def _add(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], pieces: Sequence[tuple]) -> None:
        stored = sum(p[3] for p in pieces)
        if stored != math.prod(shape):
            raise InvalidManifest(f"{self.tag_folder.url}: {key!r} has shape {list(shape)}, and the files hold "
                                  f"{stored} of its elements")
        self._entries[key] = TensorEntry(key, dtype, shape, (StoredChunk((0,) * len(shape), shape, tuple(pieces)),))

    def _resolved(self, pieces: Sequence[Piece], flats: Mapping[Hashable, tuple[torch.Tensor, MappedTorchFile]]
                  ) -> list[tuple]:
        return [(*flats[p.source], p.start, p.count) for p in pieces]

    def _add_whole(self, name: str, t: torch.Tensor) -> None:
        """``model.<name>`` stored whole in the (first) model-state file's module state dict."""
        self._add(f"model.{name}", t.dtype, tuple(t.shape), [(t.reshape(-1), self._files[0], 0, t.numel())])

    def _module(self, model: dict) -> None:
        """Buffers come from the module state dict as stored (DeepSpeed's reconstruction keeps them too)."""
        module = model["module"]
        for name in model.get("buffer_names") or ():
            t = module.get(name)
            if isinstance(t, torch.Tensor):
                self._add_whole(name, t)

    def _module_leftovers(self, model: dict, groups: Sequence[Mapping[str, Any]]) -> None:
        """Module tensors no partition holds: frozen parameters of a stage-1 save, which records no
        ``frozen_param_shapes`` and keeps them only in the module state dict (in the module's dtype)."""
        trained = {n for g in groups for n in g} | set(model.get("shared_params") or {})
        for name, t in model["module"].items():
            if (isinstance(t, torch.Tensor) and t.numel() and name not in trained
                    and f"model.{name}" not in self._entries):
                self._add_whole(name, t)

    def _full_params(self, model: dict) -> None:
        """Stage 0: the module state dict holds every parameter whole."""
        for name, t in model["module"].items():
            if isinstance(t, torch.Tensor) and f"model.{name}" not in self._entries:
                self._add_whole(name, t)

    def _frozen(self, models: Sequence[dict]) -> None:
        """Frozen parameters: whole in the model-state file (stages 1/2) or one share per rank's (stage 3)."""
        shapes = models[0].get("frozen_param_shapes") or {}
        for name, shape in shapes.items():
            shape = tuple(int(x) for x in shape)
            frags = [(m.get("frozen_param_fragments") or {}).get(name) for m in models]
            if any(not isinstance(f, torch.Tensor) for f in frags):
                raise InvalidManifest(f"{self.tag_folder.url}: frozen parameter {name!r} has no stored fragment")
            flats = {r: (f.reshape(-1), self._files[r]) for r, f in enumerate(frags)}
            pieces = spread_pieces(math.prod(shape), [f.numel() for f in frags], list(range(len(frags))))
            self._add(f"model.{name}", frags[0].dtype, shape, self._resolved(pieces, flats))

    def _zero12(self, sd: Sequence[dict], groups: Sequence[Mapping[str, Any]], models: Sequence[dict],
                where: str) -> None:
        parts = [s.get("single_partition_of_fp32_groups") for s in sd]
        if any(not isinstance(p, (list, tuple)) or len(p) != len(groups) for p in parts):
            raise InvalidManifest(f"{where}: every optimizer-state file holds one fp32 partition per param group "
                                  f"({len(groups)}); one does not")
        files = self._files[-len(sd):]
        layout = zero12_pieces(groups, [[t.numel() for t in p] for p in parts], sd[0].get("param_alignment_paddings"),
                               where)
        flats = {(r, g): (t.reshape(-1), files[r]) for r, p in enumerate(parts) for g, t in enumerate(p)}
        for name, (g, pieces) in layout.items():
            self._add(f"model.{name}", parts[0][g].dtype, groups[g][name], self._resolved(pieces, flats))
        self._frozen(models[:1])  # stages 1/2 store each frozen parameter whole in the one model-state file
        inner = [s.get("base_optimizer_state") for s in sd]
        # the saved fp32 partitions leave out the alignment padding of the last rank's; its optimizer state keeps it
        pads = [list(s.get("group_paddings") or [0] * len(groups)) for s in sd]
        self._optimizer(inner, parts, pads, {n: (g, g, p) for n, (g, p) in layout.items()}, groups, files, where)

    def _zero3(self, sd: Sequence[dict], groups: Sequence[Mapping[str, Any]], models: Sequence[dict],
               where: str) -> None:
        parts = [s.get("fp32_flat_groups") for s in sd]
        if any(not isinstance(p, (list, tuple)) for p in parts):
            raise InvalidManifest(f"{where}: an optimizer-state file holds no fp32_flat_groups")
        files = self._files[-len(sd):]
        layout = zero3_pieces(groups, [[t.numel() for t in p] for p in parts], where)
        flats = {(r, s): (t.reshape(-1), files[r]) for r, p in enumerate(parts) for s, t in enumerate(p)}
        for name, (g, _, pieces) in layout.items():
            self._add(f"model.{name}", parts[0][0].dtype, groups[g][name], self._resolved(pieces, flats))
        if len(models) != len(sd):
            raise InvalidManifest(f"{where}: {len(sd)} optimizer-state files and {len(models)} model-state files; "
                                  "stage 3 writes one of each per rank")
        self._frozen(models)
        inner = [s.get("optimizer_state_dict") for s in sd]
        self._optimizer(inner, parts, [[0] * len(p) for p in parts], layout, groups, files, where)

    def _optimizer(self, inner: Sequence[Any], parts: Sequence[Sequence[torch.Tensor]], pads: Sequence[Sequence[int]],
                   layout: Mapping[str, tuple[int, int, list[Piece]]], groups: Sequence[Mapping[str, Any]],
                   files: Sequence[MappedTorchFile], where: str) -> None:
        """Per-element state cut per parameter; scalars given to each parameter of their group.  A state
        tensor is per element when it has its partition's size, or that plus the partition's padding."""
        def per_element(value: Any, r: int, s: int) -> bool:
            n = parts[r][s].numel()
            pad = int(pads[r][s]) if s < len(pads[r]) else 0
            return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() in (n, n + pad)

        if any(not isinstance(o, dict) or not isinstance(o.get("state"), dict) for o in inner):
            self.skipped_side_files.append("the optimizer state (the ZeRO files hold none a torch optimizer keeps)")
            return
        states = [o["state"] for o in inner]
        flats: dict[Hashable, tuple[torch.Tensor, MappedTorchFile]] = {}
        kinds: dict[int, dict[str, Any]] = {}  # partition -> key -> "elements", or the scalar every parameter gets
        for s, part in enumerate(parts[0]):
            for key, value in (states[0].get(s) or {}).items():
                if per_element(value, 0, s):
                    kinds.setdefault(s, {})[key] = "elements"
                elif not isinstance(value, torch.Tensor) or value.numel() == 1:
                    kinds.setdefault(s, {})[key] = value
                else:
                    self.skipped_side_files.append(f"optimizer state {key!r} of partition {s} "
                                                   f"({tuple(value.shape)}): not one value per element, so it "
                                                   "cannot be cut per parameter")
        for r, state in enumerate(states):
            for s, part in enumerate(parts[r]):
                for key in [k for k, kind in kinds.get(s, {}).items() if isinstance(kind, str)]:
                    value = (state.get(s) or {}).get(key)
                    if not per_element(value, r, s):
                        raise InvalidManifest(f"{files[r].url}: optimizer state {key!r} of partition {s} is "
                                              f"missing or not {part.numel()} elements (plus padding), as on rank 0")
                    flats[(key, r, s)] = (value.reshape(-1), files[r])
        for name, (g, sub, pieces) in layout.items():
            for key, kind in kinds.get(sub, {}).items():
                full = f"optim.state.{name}.{key}"
                if isinstance(kind, str):
                    keyed = [Piece((key, *p.source), p.start, p.count) for p in pieces]
                    self._add(full, flats[(key, 0, sub)][0].dtype, tuple(groups[g][name]), self._resolved(keyed, flats))
                elif isinstance(kind, torch.Tensor):
                    self._add(full, kind.dtype, tuple(kind.shape), [(kind.reshape(-1), files[0], 0, 1)])
                elif (value := self._json(kind, full)) is not _DROPPED:
                    self._values[full] = value
        self._param_groups(inner[0].get("param_groups"), layout, groups, where)

    def _param_groups(self, inner_groups: Any, layout: Mapping[str, tuple[int, int, list[Piece]]],
                      groups: Sequence[Mapping[str, Any]], where: str) -> None:
        """One group per param group of the optimizer DeepSpeed wraps, with its hyperparameters.  That
        optimizer's groups list the partitions they own (stage 3 splits a group into sub-groups, each a
        partition of its own), so each parameter goes to the group owning the partition that holds it."""
        if not isinstance(inner_groups, (list, tuple)):
            return
        owner: dict[int, int] = {}
        for gi, group in enumerate(inner_groups):
            for partition in (group.get("params") or []) if isinstance(group, dict) else []:
                if isinstance(partition, int):
                    owner[partition] = gi
        names_of: dict[int, list[str]] = {gi: [] for gi in range(len(inner_groups))}
        for shapes in groups:
            for name in shapes:
                if name in layout:
                    gi = owner.get(layout[name][1])
                    if gi is None:
                        raise InvalidManifest(f"{where}: no optimizer param group owns partition {layout[name][1]}, "
                                              f"which holds {name!r}")
                    names_of[gi].append(name)
        out = []
        for gi, group in enumerate(inner_groups):
            hyper = {k: self._json(v, f"optim.param_groups.{gi}.{k}") for k, v in group.items() if k != "params"}
            out.append({**{k: v for k, v in hyper.items() if v is not _DROPPED}, "params": names_of[gi]})
        self._values["optim.param_groups"] = out

    def _json(self, value: Any, key: str) -> Any:
        try:
            return to_json_value(value.item() if isinstance(value, torch.Tensor) else value, key)
        except ConfigurationError:
            self.skipped_side_files.append(f"{key}: a {type(value).__name__}, neither a tensor nor a JSON value")
            return _DROPPED

    def _scheduler(self, state: Any) -> None:
        if not isinstance(state, dict) or not state:
            return
        try:
            self._values.update(plain_values("lr_scheduler", state))
        except ConfigurationError as exc:
            self.skipped_side_files.append(f"the lr_scheduler state ({exc})")

    # ------------------------------------------------------------------ reading
    def tensors(self) -> Mapping[str, TensorEntry]:
        return self._entries

    def values(self) -> Mapping[str, Any]:
        return self._values

    def aliases(self) -> Mapping[str, str]:
        return self._aliases

    def read(self, requests: Sequence[ReadRequest]) -> None:
        entries = self.check_requests(requests)
        for r, entry in zip(requests, entries):  # every record the requests need is checked before any out is written
            for flat, file, _, _ in entry.chunks[0].locator:
                file.ensure_checked(flat, f"{file.url} [{r.fqn}]")
        for r, entry in zip(requests, entries):
            chunk = entry.chunks[0]
            r0, r1 = row_range(chunk.offsets, r.box)
            row = math.prod(entry.shape[1:]) if entry.shape else 1
            spans = _spans(chunk.locator, r0 * row, (r1 - r0) * row)
            # a view of the mapped file, or a copy of just these elements
            flat = (spans[0][0] if len(spans) == 1 else torch.cat([t for t, _ in spans]) if spans
                    else torch.empty(0, dtype=entry.dtype))
            rows = flat.view(()) if not entry.shape else flat.view((r1 - r0, *entry.shape[1:]))
            copy_rows_into(rows, chunk.offsets, r.box, r.out)
            for span, file in spans:  # the mapped pages just copied leave this process's RSS
                file.release(span)
            self.stats.add(read=r.out.numel() * r.out.element_size(), requests=1)

    def archives(self) -> list[tuple[Storage, str]]:
        """The torch.save files this checkpoint is read from (``verify`` checks their CRC-32s)."""
        return [(self.tag_folder, n) for n in self.file_names]

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []


_DROPPED = object()


def _spans(pieces: Sequence[tuple], lo: int, n: int) -> list[tuple[torch.Tensor, MappedTorchFile]]:
    """Elements ``[lo, lo + n)`` of a tensor stored as ``pieces``: (view of the mapped file, the file), in
    order.  Which pieces hold them is :func:`.layout.cut`'s rule, applied to the pieces themselves."""
    sizes = [p[3] for p in pieces]
    starts = starts_of(sizes)
    return [(pieces[i][0][pieces[i][2] + p.start:pieces[i][2] + p.start + p.count], pieces[i][1])
            for p in cut(lo, n, starts, sizes, range(len(pieces))) for i in (p.source,)]
