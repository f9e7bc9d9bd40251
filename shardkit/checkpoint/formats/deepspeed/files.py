"""Which files make one DeepSpeed ZeRO save, and whether they agree with each other.

DeepSpeed's checkpoint directory holds ``latest`` (the newest tag) and one folder per tag; a tag folder holds
``[zero_pp_rank_R_]mp_rank_00_model_states.pt`` and one ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``
per data-parallel rank.  This module finds the tag folder, lists its state files in rank order, refuses
model- and pipeline-parallel saves by their names, and checks the top level of what the files hold (a
``module``, an ``optimizer_state_dict``, one file per rank the partitions were cut over).  It is DeepSpeed's
own bookkeeping, kept apart from :mod:`.reader`, which maps what the files hold onto shardkit's keys.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from shardkit.checkpoint.io.names import check_name
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import InvalidManifest, UnsupportedFormat

__all__ = ["LATEST", "MODEL_STATES", "tag_folder", "state_files", "check_model_states", "optimizer_state_dicts",
           "world_size"]

LATEST = "latest"
MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_STATES = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_PIPELINE = re.compile(r"^layer_\d+-model.*\.pt$")


def tag_folder(storage: Storage) -> tuple[Storage, str | None]:
    """The folder holding the state files: ``storage`` itself, or the tag its ``latest`` names."""
    names = storage.listdir()
    if any(MODEL_STATES.match(n) for n in names):
        return storage, None
    if LATEST not in names:
        raise UnsupportedFormat(f"{storage.url}: neither a DeepSpeed tag folder (*_model_states.pt) nor a "
                                f"checkpoint directory with a {LATEST!r} file")
    tag = check_name(storage.read_bytes(LATEST).decode("utf-8", "replace").strip(), storage.where(LATEST))
    if "/" in tag:
        raise InvalidManifest(f"{storage.where(LATEST)}: names {tag!r}, not a tag folder of this directory")
    if not storage.is_dir(tag):
        raise InvalidManifest(f"{storage.where(LATEST)}: names tag {tag!r}, and {storage.where(tag)} does not exist")
    return storage.child(tag), tag


def state_files(folder: Storage) -> tuple[list[str], list[str]]:
    """The model-state and the optimizer-state files of a tag folder, each in rank order; a model- or
    pipeline-parallel save is refused by its file names, a folder without model states too."""
    names = folder.listdir()
    for n in names:
        m = MODEL_STATES.match(n) or _OPTIM_STATES.match(n)
        if (m and int(m.group(2)) != 0) or _PIPELINE.match(n):
            raise UnsupportedFormat(f"{folder.where(n)}: a tensor- or pipeline-parallel DeepSpeed checkpoint; "
                                    "shardkit reads ZeRO data-parallel checkpoints (mp_rank_00 only)")
    model_names = sorted((n for n in names if MODEL_STATES.match(n)),
                         key=lambda n: int(MODEL_STATES.match(n).group(1) or 0))
    optim_names = sorted((n for n in names if _OPTIM_STATES.match(n)),
                         key=lambda n: int(_OPTIM_STATES.match(n).group(1)))
    if not model_names:
        raise InvalidManifest(f"{folder.url}: no *_model_states.pt; not a DeepSpeed checkpoint's tag folder")
    return model_names, optim_names


def check_model_states(folder: Storage, names: Sequence[str], models: Sequence[Any]) -> None:
    """Each model-state file holds a dict with the module's state dict under ``module``."""
    for name, obj in zip(names, models):
        if not isinstance(obj, dict) or not isinstance(obj.get("module"), dict):
            raise InvalidManifest(f"{folder.where(name)}: not a DeepSpeed model-state file (no 'module')")


def optimizer_state_dicts(folder: Storage, names: Sequence[str], optims: Sequence[Any]) -> list[dict]:
    """Each optimizer-state file's ``optimizer_state_dict``: the ZeRO optimizer's partition of one rank."""
    sd = [o.get("optimizer_state_dict") if isinstance(o, dict) else None for o in optims]
    for name, s in zip(names, sd):
        if not isinstance(s, dict):
            raise InvalidManifest(f"{folder.where(name)}: not a DeepSpeed optimizer-state file "
                                  "(no 'optimizer_state_dict')")
    return sd


def world_size(sd: Sequence[dict], names: Sequence[str], folder: Storage) -> int | None:
    """The number of ranks the partitions were cut over (``None`` without optimizer states), once the files
    are one per rank, ranks 0 to that number; ``names`` are the optimizer-state files, in rank order."""
    if not sd:
        return None
    counts = sd[0].get("partition_count")
    if isinstance(counts, (list, tuple)):
        if len(set(counts)) > 1:
            raise UnsupportedFormat(f"{folder.where(names[0])}: param groups partitioned over different "
                                    f"numbers of ranks ({list(counts)}; expert parallelism) are not supported")
        counts = counts[0] if counts else len(sd)
    if int(counts) != len(sd):
        raise InvalidManifest(f"{folder.url}: partitioned over {counts} ranks, and {len(sd)} optimizer-state "
                              "files are there (a rank's file missing, or files of another save)")
    ranks = [int(_OPTIM_STATES.match(n).group(1)) for n in names]
    if ranks != list(range(len(ranks))):
        raise InvalidManifest(f"{folder.url}: optimizer-state files for ranks {ranks}; a rank's file is missing")
    return int(counts)
