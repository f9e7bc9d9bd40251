"""Hugging Face Trainer and Accelerate checkpoint folders, read as one checkpoint.

``Accelerator.save_state(DIR)`` and the Trainer's ``checkpoint-N/`` keep a
training run's state in several files, each in a format shardkit reads on its
own; this reader puts them together under shardkit's keys:

=================================  =====================================  ===============
file(s)                            what                                   keys
=================================  =====================================  ===============
``pytorch_model_fsdp_0/``          FSDP sharded state dict (DCP, or       ``model.*``
                                   shardkit's under ``use_shardkit()``)
``pytorch_model_fsdp.bin``         FSDP full state dict (torch.save)      ``model.*``
``model.safetensors`` (+ index),   the DDP fallback's weights             ``model.*``
``pytorch_model.bin``
``optimizer_0/``                   FSDP sharded optimizer state (DCP,     ``optim.*``
                                   or shardkit's)
``optimizer.bin``/``optimizer.pt``  full (FQN-keyed) or DDP (numbered)     ``optim.*``
``random_states_<r>.pkl``,         every rank's RNG                       ``rng.*``
``rng_state_<r>.pth``
``scheduler.bin``/``scheduler.pt``  the LR scheduler's state               ``lr_scheduler.*``
``trainer_state.json``             the step                               info.meta
=================================  =====================================  ===============

Optimizer state keyed by parameter number (the DDP fallback) is named from
``--model-keys`` or, failing that, from the model class ``config.json`` names
(:mod:`.param_order`); when neither fits, the numbers are kept (and a
conversion that writes optimizer state refuses, saying what to pass).  Every
part is read by its own format's reader, so its checks (CRC-32 of zip
records, DCP metadata through the allowlisting unpickler) apply unchanged.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import CheckpointInfo, CheckpointReader, ReadRequest, StoredChunk, TensorEntry
from shardkit.checkpoint.formats.dcp.handler import DCP
from shardkit.checkpoint.formats.dcp.reader import DcpReader
from shardkit.checkpoint.formats.hf.handler import HF
from shardkit.checkpoint.formats.hf.reader import side_files_in
from shardkit.checkpoint.formats.native import NATIVE, NativeReader
from shardkit.checkpoint.formats.torchsave.handler import TORCH
from shardkit.checkpoint.formats.torchsave.mapped import MappedTorchFile
from shardkit.checkpoint.formats.torchsave.reader import TorchLoadOptions
from shardkit.checkpoint.formats.torchsave.state import UNNAMED_HINT
from shardkit.checkpoint.formats.trainer.param_order import fits, named_groupings
from shardkit.checkpoint.formats.trainer.rng import RNG_FILE, SINGLE_PROCESS_FILE, read_rng_state, rng_files
from shardkit.checkpoint.geometry.rows import copy_box
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.tree import plain_values
from shardkit.errors import ConfigurationError, InvalidManifest, UnsupportedFormat

__all__ = ["TrainerReader", "detect", "open_reader", "MODEL_PARTS", "OPTIMIZER_PARTS"]

# model.safetensors before its index: the one from_pretrained (and HfReader) loads when both are there
MODEL_PARTS = ("pytorch_model_fsdp_0", "pytorch_model_fsdp.bin", "model.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin")
OPTIMIZER_PARTS = ("optimizer_0", "optimizer.bin", "optimizer.pt")
SCHEDULER_PARTS = ("scheduler.bin", "scheduler.pt")
TRAINER_STATE = "trainer_state.json"
_NUMBERED = re.compile(r"^optim\.state\.(\d+)\.(.+)$")
_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "acc_delta")


def detect(storage: Storage) -> bool:
    """An FSDP model part, or weights together with what only a training run saves beside them."""
    if not storage.is_dir():
        return False
    names = set(storage.listdir())
    if "pytorch_model_fsdp_0" in names or "pytorch_model_fsdp.bin" in names:
        return True
    training = any(n in names for n in (*OPTIMIZER_PARTS, TRAINER_STATE)) or any(
        RNG_FILE.match(n) or n == SINGLE_PROCESS_FILE for n in names)
    return training and any(n in names for n in MODEL_PARTS[2:])


def open_reader(storage: Storage, torch_options: TorchLoadOptions | None = None) -> "TrainerReader":
    return TrainerReader(storage, torch_options)


@dataclass
class _Part:
    """One file (or folder) of the checkpoint and how its keys become ours (``None``: left out)."""

    name: str
    reader: CheckpointReader
    ours: Callable[[str], str | None]


class _InMemory(CheckpointReader):
    """Small tensors read whole at open (the RNG states)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], url: str) -> None:
        super().__init__()
        self._tensors = dict(tensors)
        self._entries = {k: TensorEntry(k, t.dtype, tuple(t.shape), (StoredChunk((0,) * t.dim(), tuple(t.shape)),))
                         for k, t in self._tensors.items()}
        self.info = CheckpointInfo("memory", url)

    def tensors(self) -> Mapping[str, TensorEntry]:
        return self._entries

    def values(self) -> Mapping[str, Any]:
        return {}

    def read(self, requests: Sequence[ReadRequest]) -> None:
        self.check_requests(requests)
        for r in requests:
            copy_box(self._tensors[r.fqn], self._entries[r.fqn].chunks[0].offsets, r.box, r.out)


class TrainerReader(CheckpointReader):
    """A Trainer/Accelerate checkpoint folder; see the module docstring."""

    def __init__(self, storage: Storage, torch_options: TorchLoadOptions | None = None) -> None:
        super().__init__()
        self.storage = storage
        self.parts: list[_Part] = []
        self._entries: dict[str, TensorEntry] = {}
        self._route: dict[str, tuple[_Part, str]] = {}
        self._values: dict[str, Any] = {}
        self.skipped_side_files: list[str] = []
        # config.json, generation_config.json and tokenizer files travel to --to hf
        self.folder, self.side_files = storage, side_files_in(storage)[0]
        opts = torch_options or TorchLoadOptions()
        if opts.trust_pickle:
            raise ConfigurationError(f"{storage.url}: --trust-pickle applies to one torch.save file; the parts of a "
                                     "Trainer/Accelerate folder are always read through the allowlist")
        try:
            names = storage.listdir()
            self._model(storage, names)
            self._optimizer(storage, names, opts)
            self._extras(storage, names)
            for part in self.parts:
                self._add_part(part)
        except BaseException:
            self.close()
            raise
        rng = rng_files(names, storage.url)
        self.info = CheckpointInfo("trainer", storage.url, world_size=len(rng) or None, meta=self._meta(storage))

    # ----------------------------------------------------------------- parts
    def _open(self, storage: Storage, name: str) -> CheckpointReader:
        """The reader of one part, by its name, from the handler of the part's format: a torch.save file,
        safetensors weights (the folder read as an HF checkpoint), a shardkit checkpoint (what
        ``shardkit.integrations.accelerate.use_shardkit()`` writes under Accelerate's names) or a DCP folder."""
        child = storage.child(name)
        if name.endswith((".bin", ".pt")):
            return TORCH.open_reader(child)
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            return HF.open_reader(storage)
        if NATIVE.detect(child):
            return NATIVE.open_reader(child)
        return DCP.open_reader(child)

    def _model(self, storage: Storage, names: Sequence[str]) -> None:
        name = next((n for n in MODEL_PARTS if n in names), None)
        if name is None:
            raise UnsupportedFormat(f"{storage.url}: no model weights ({', '.join(MODEL_PARTS)})")
        reader = self._open(storage, name)
        self.parts.append(_Part(name, reader, lambda k: k if k.startswith("model.") else None))

    def _optimizer(self, storage: Storage, names: Sequence[str], opts: TorchLoadOptions) -> None:
        name = next((n for n in OPTIMIZER_PARTS if n in names), None)
        if name is None:
            return
        reader = self._open(storage, name)
        # accelerate saves {"optimizer": ...}, which DCP's reader reads as optim.*; use_shardkit saves {"optim": ...}
        if isinstance(reader, (DcpReader, NativeReader)):
            self.parts.append(_Part(name, reader, lambda k: k if k.startswith("optim.") else None))
            self._values.update({k: v for k, v in reader.values().items() if k.startswith("optim.")})
            return
        numbers = self._numbering(storage, name, reader, opts)
        if numbers is None:
            ours: Callable[[str], str | None] = lambda k: k if k.startswith("optim.") else None  # noqa: E731
        else:
            def ours(k: str) -> str | None:
                m = _NUMBERED.match(k)
                return f"optim.state.{numbers[m.group(1)]}.{m.group(2)}" if m else (k if k.startswith("optim.")
                                                                                    else None)
        self.parts.append(_Part(name, reader, ours))
        for key, value in reader.values().items():
            if key == "optim.param_groups" and numbers is not None:
                value = [{**g, "params": [numbers[str(p)] for p in g.get("params", ())]} for g in value]
            if key.startswith("optim."):
                self._values[key] = value

    def _numbering(self, storage: Storage, name: str, reader: CheckpointReader,
                   opts: TorchLoadOptions) -> dict[str, str] | None:
        """Parameter number -> FQN for a numbered optimizer state; ``None`` when it is keyed by name."""
        groups = reader.values().get("optim.param_groups")
        numbered = [k for k in reader.tensors() if _NUMBERED.match(k)]
        if not numbered or not isinstance(groups, list):
            return None
        shapes = {(m.group(1), m.group(2)): tuple(e.shape) for k, e in reader.tensors().items()
                  if (m := _NUMBERED.match(k))}
        listed = {str(p) for g in groups if isinstance(g, dict) for p in g.get("params", ())}
        stray = sorted({number for number, _ in shapes} - listed, key=int)
        if stray:
            raise InvalidManifest(f"{storage.where(name)}: the optimizer state holds parameter {stray[0]}, which no "
                                  "param group lists")
        candidates = named_groupings(storage)
        if opts.model_keys is not None:
            sizes, keys, given = [len(g.get("params", ())) for g in groups], list(opts.model_keys), []
            for n in sizes:
                given.append([k[len("model."):] if k.startswith("model.") else k for k in keys[:n]])
                keys = keys[n:]
            candidates = [(given, {})]
        for grouping, param_shapes in candidates:
            if fits(grouping, param_shapes, groups, shapes, _SHAPED):
                return {str(p): n for g, names in zip(groups, grouping) for p, n in zip(g.get("params", ()), names)}
        why = (f"{storage.where(name)}: the optimizer state is keyed by parameter number and the numbers cannot be "
               "named (" + ("--model-keys does not fit its param groups" if opts.model_keys is not None else
                            "config.json names no model class transformers builds whose parameters fit it"
                            if storage.exists("config.json") else "no config.json beside it") + ")")
        if opts.need_names:
            raise UnsupportedFormat(f"{why}; {UNNAMED_HINT}")
        self.skipped_side_files.append(why)
        return None

    def _extras(self, storage: Storage, names: Sequence[str]) -> None:
        rng = rng_files(names, storage.url)
        if rng:
            tensors, values = read_rng_state(storage, rng)
            self._values.update(values)
            self.parts.append(_Part("rng", _InMemory(tensors, storage.url), lambda k: k))
        name = next((n for n in SCHEDULER_PARTS if n in names), None)
        if name is not None:
            file = MappedTorchFile(storage.child(name), unsafe_hint="a scheduler file holds its state dict")
            try:
                self._values.update(plain_values("lr_scheduler", file.obj))
            except ConfigurationError as exc:
                self.skipped_side_files.append(f"{storage.where(name)}: {exc}")
            finally:
                file.close()

    def _add_part(self, part: _Part) -> None:
        for key, entry in part.reader.tensors().items():
            ours = part.ours(key)
            if ours is not None:
                self._entries[ours] = TensorEntry(ours, entry.dtype, entry.shape, entry.chunks)
                self._route[ours] = (part, key)

    def _meta(self, storage: Storage) -> dict[str, Any]:
        meta: dict[str, Any] = {"parts": [p.name for p in self.parts if p.name != "rng"]}
        if storage.exists(TRAINER_STATE):
            try:
                state = json.loads(storage.read_bytes(TRAINER_STATE))
                if isinstance(state, dict) and isinstance(state.get("global_step"), int):
                    meta["step"] = state["global_step"]
            except (ValueError, UnicodeError):
                self.skipped_side_files.append(f"{storage.where(TRAINER_STATE)}: not JSON")
        return meta

    # --------------------------------------------------------------- reading
    def tensors(self) -> Mapping[str, TensorEntry]:
        return self._entries

    def values(self) -> Mapping[str, Any]:
        return self._values

    def declares_tied(self, fqn: str) -> bool:
        """As the model part says (its keys are ours): an HF part by the folder's ``config.json``."""
        return fqn.startswith("model.") and self.parts[0].reader.declares_tied(fqn)

    def read(self, requests: Sequence[ReadRequest]) -> None:
        self.check_requests(requests)
        by_part: dict[int, tuple[_Part, list[ReadRequest]]] = {}
        for r in requests:
            part, theirs = self._route[r.fqn]
            by_part.setdefault(id(part), (part, []))[1].append(ReadRequest(theirs, r.chunk, r.box, r.out))
        for part, mine in by_part.values():  # each part validates all of its requests before writing any
            part.reader.read(mine)
        self.stats.add(read=sum(r.out.numel() * r.out.element_size() for r in requests), requests=len(requests))

    def archives(self) -> list[tuple[Storage, str]]:
        """The torch.save files of this folder (weights, optimizer, RNG, scheduler): ``verify`` checks them."""
        names = self.storage.listdir()
        return [(self.storage, n) for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))
                and (n in MODEL_PARTS or n in OPTIMIZER_PARTS or n in SCHEDULER_PARTS
                     or n in rng_files(names, self.storage.url))]

    def dcp_parts(self) -> list[DcpReader]:
        return [p.reader for p in self.parts if isinstance(p.reader, DcpReader)]

    def native_parts(self) -> list[NativeReader]:
        """The shardkit checkpoints among the parts (``use_shardkit()``'s model and optimizer folders)."""
        return [p.reader for p in self.parts if isinstance(p.reader, NativeReader)]

    def close(self) -> None:
        for part in self.parts:
            part.reader.close()
