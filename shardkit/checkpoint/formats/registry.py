"""The format registry and the one door to read any checkpoint.

Adding a format means its folder, with a :class:`~shardkit.checkpoint.formats.handler.FormatHandler`
in ``formats/<name>/handler.py``, and one line in :data:`FORMATS`; nothing
else names formats (the CLI's choices, detection, commit markers, the aliases
a user may type, and what convert, verify and ``--overwrite`` do for each
format all come from the handlers listed here).

:func:`open_reader` is how everything opens a checkpoint: ``load``,
``reshard``, ``convert``, ``inspect``, ``verify`` and ``diff``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Collection, Mapping

from shardkit.checkpoint.formats.base import CheckpointReader
from shardkit.checkpoint.formats.dcp.handler import DCP
from shardkit.checkpoint.formats.deepspeed.handler import DEEPSPEED
from shardkit.checkpoint.formats.handler import FormatHandler
from shardkit.checkpoint.formats.hf.handler import HF
from shardkit.checkpoint.formats.native import NATIVE, referenced_by_siblings
from shardkit.checkpoint.formats.torch_checkpointing.handler import TORCH_CHECKPOINTING
from shardkit.checkpoint.formats.torchsave.handler import TORCH
from shardkit.checkpoint.formats.trainer.handler import TRAINER
from shardkit.checkpoint.formats.write_job import Scaleout, WriteJob, Written
from shardkit.checkpoint.io.storage import Storage, split_file
from shardkit.errors import ArgumentTypeError, CheckpointNotFound, ConfigurationError, UnsupportedFormat

__all__ = ["FormatHandler", "FORMATS", "WRITABLE", "COMMIT_MARKERS", "CHECKPOINT_FILE_PATTERNS", "CHECKPOINT_FOLDERS",
           "NATIVE", "WriteJob", "Written", "Scaleout", "referenced_by_siblings",
           "normalize_format", "handler_for", "writer_for", "foreign_kind", "detect_format", "open_reader"]

# detection tries them in this order (native first)
FORMATS: dict[str, FormatHandler] = {f.name: f for f in (
    NATIVE,
    # before trainer: a Trainer run with DeepSpeed keeps its ZeRO state (latest, global_stepN/) in checkpoint-N/
    DEEPSPEED,
    # before hf: a step folder's items may be safetensors files beside its metadata.pkl
    TORCH_CHECKPOINTING,
    # before hf: a Trainer's checkpoint-N/ holds model.safetensors too, beside the optimizer and RNG states
    TRAINER,
    HF,
    TORCH,
    DCP,
)}

WRITABLE: tuple[str, ...] = tuple(name for name, f in FORMATS.items() if f.writable)

COMMIT_MARKERS: tuple[str, ...] = tuple(m for f in FORMATS.values() for m in f.markers)

# the folders inside a checkpoint directory that hold its data files (native's data/)
CHECKPOINT_FOLDERS: tuple[str, ...] = tuple(dict.fromkeys(d for f in FORMATS.values() for d in f.data_folders))

# the shapes of the files the writers create, and of storage's temporary names for files being streamed
CHECKPOINT_FILE_PATTERNS: tuple[str, ...] = tuple(dict.fromkeys(
    ["*.partial-*", *(p for f in FORMATS.values() for p in f.file_patterns)]))


def normalize_format(name: str) -> str:
    """The canonical format name for a user's spelling (``native``, ``pt``, ``safetensors``...)."""
    lowered = name.lower()
    for f in FORMATS.values():
        if lowered == f.name or lowered in f.aliases:
            return f.name
    raise UnsupportedFormat(f"format {name!r} is unknown; use one of {', '.join(FORMATS)}")


def handler_for(name: str) -> FormatHandler:
    """The handler of format ``name``, in any spelling a user may type."""
    return FORMATS[normalize_format(name)]


def writer_for(name: str) -> FormatHandler:
    """The handler of format ``name`` for writing; a read-only format is refused, naming the writable ones."""
    handler = handler_for(name)
    if not handler.writable:
        raise UnsupportedFormat(f"shardkit reads {handler.name} checkpoints and does not write them; convert to "
                                f"one of {', '.join(WRITABLE)}")
    return handler


def foreign_kind(names: Collection[str]) -> str | None:
    """The description of the non-native format whose checkpoint files are among ``names`` (a directory's
    foreign names), if any: what a warning about a directory shardkit will not touch names it as."""
    for fmt in FORMATS.values():  # what makes a directory another tool's checkpoint (the registry's markers)
        if fmt is not NATIVE and any(marker in names for marker in fmt.markers):
            return fmt.description
    if any(n.endswith(".distcp") for n in names):
        return DCP.description
    return None


def detect_format(storage: Storage) -> str:
    """The first format that recognises ``storage`` (native first); a path with no checkpoint gets an
    error that says what is there (nothing, data without a commit, or other files)."""
    if not storage.exists():
        raise CheckpointNotFound(f"{storage.url}: no such file or directory")
    for name, handler in FORMATS.items():
        if handler.detect(storage):
            return name
    if storage.is_dir():
        names = storage.listdir()
        if "data" in names or any(n.endswith(".safetensors") or n.endswith(".distcp") for n in names):
            raise CheckpointNotFound(f"{storage.url}: holds data files but no manifest/index/metadata: not a "
                                     "committed checkpoint (an interrupted write?); rerun the command that wrote it")
        shown = (", ".join(names[:5]) + (", ..." if len(names) > 5 else "")) if names else "an empty directory"
        raise UnsupportedFormat(f"{storage.url}: not a checkpoint shardkit reads (found {shown}); expected "
                                + ", ".join(f"a {f.description}" for f in FORMATS.values()))
    parent, name = split_file(storage)
    parent.read_bytes(name, 0, 8)  # an unreadable file says so (permission denied) instead of "unknown format"
    raise UnsupportedFormat(f"{storage.url}: unknown file format (neither safetensors nor a torch.save zip)")


def open_reader(url: str | Storage, storage_options: Mapping[str, Any] | None = None, *,
                format: str | None = None, trust_pickle: bool = False, **options: Any) -> CheckpointReader:
    """Open ``url`` in ``format`` (detected when ``None``): the one way every tool opens a checkpoint.

    ``options`` go to the format's reader when it takes them (``io_threads``
    for native, ``torch_options`` for torch.save).  A request the format cannot
    honour (``torch_options`` asking to trust pickles for a DCP directory) is
    refused, never silently ignored; a mere hint (``io_threads``) is dropped.
    ``trust_pickle=True`` is ``torch_options=TorchLoadOptions(trust_pickle=True)``
    (the CLI's ``--trust-pickle``): honoured by the formats that unpickle, refused
    by the others.  An option no format takes is a caller's typo: refused
    (:class:`~shardkit.errors.ArgumentTypeError`, a ``TypeError`` as Python's own).
    """
    unknown = sorted(set(options) - {o for handler in FORMATS.values() for o in handler.open_options})
    if unknown:
        raise ArgumentTypeError(f"open_reader() got an unexpected keyword argument {unknown[0]!r} (options a "
                                "reader takes: trust_pickle, " + ", ".join(sorted(
                                    {o for handler in FORMATS.values() for o in handler.open_options})) + ")")
    if trust_pickle:
        from shardkit.checkpoint.formats.torchsave.reader import TorchLoadOptions

        options["torch_options"] = replace(options.get("torch_options") or TorchLoadOptions(), trust_pickle=True)
    storage = url if isinstance(url, Storage) else Storage(url, storage_options)
    name = normalize_format(format) if format else detect_format(storage)
    fmt = FORMATS[name]
    given = {k: v for k, v in options.items() if v is not None}
    for key in sorted(k for k in given if k not in fmt.open_options):
        if _is_set(given[key]):
            why = getattr(given[key], "refused_for", lambda n: f"{key} does not apply to a {n} checkpoint")(name)
            raise ConfigurationError(f"{storage.url}: {why}; drop it")
    return fmt.open_reader(storage, **{k: v for k, v in given.items() if k in fmt.open_options})


def _is_set(value: Any) -> bool:
    """Whether an option asks for something (an object with ``is_set()``, e.g. ``TorchLoadOptions``);
    plain values are hints."""
    is_set = getattr(value, "is_set", None)
    return bool(is_set()) if callable(is_set) else False
