"""The format registry and the one door to read any checkpoint.

Adding a format means one :class:`Format` entry here and the format's own
module(s); nothing else names formats (the CLI's choices, detection, commit
markers and the aliases a user may type all come from :data:`FORMATS`).

A format's *reader* module has ``detect(storage) -> bool`` and
``open_reader(storage, **options) -> CheckpointReader``; its *writer* module has
``check_tensors(triples)`` (what it cannot hold is refused before DST is
touched) and its write function.  :func:`open_reader` is how everything opens
a checkpoint: ``load``, ``reshard``, ``convert``, ``inspect``, ``verify`` and
``diff``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping

from shardkit.checkpoint.formats.base import CheckpointReader
from shardkit.checkpoint.io.storage import Storage, split_file
from shardkit.errors import CheckpointNotFound, ConfigurationError, UnsupportedFormat

__all__ = ["Format", "FORMATS", "WRITABLE", "COMMIT_MARKERS", "normalize_format", "format_module", "detect_format",
           "open_reader"]


@dataclass(frozen=True)
class Format:
    """One checkpoint format: where its code is and how a user and a directory name it."""

    name: str
    description: str
    reader: str                       # module: detect(), open_reader()
    writer: str | None                # module: check_tensors(), the write function; None: read only
    aliases: tuple[str, ...] = ()     # other spellings a user may type (--from/--to)
    markers: tuple[str, ...] = ()     # files whose presence makes a directory this format's checkpoint
    open_options: tuple[str, ...] = ()  # keyword options its open_reader takes


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("shardkit", "native: manifest.json + safetensors chunks", "shardkit.checkpoint.formats.native.reader",
           "shardkit.checkpoint.formats.native.writer", ("native",), ("manifest.json",), ("io_threads",)),
    # before trainer: a Trainer run with DeepSpeed keeps its ZeRO state (latest, global_stepN/) in checkpoint-N/
    Format("deepspeed", "DeepSpeed ZeRO checkpoint (latest + global_stepN/*_states.pt; read only)",
           "shardkit.checkpoint.formats.deepspeed.reader", None, ("ds", "zero"), ("latest",)),
    # before hf: a Trainer's checkpoint-N/ holds model.safetensors too, beside the optimizer and RNG states
    Format("trainer", "Hugging Face Trainer / Accelerate checkpoint folder (model, optimizer, RNG; read only)",
           "shardkit.checkpoint.formats.trainer.reader", None, ("accelerate", "hf-trainer"), (),
           ("torch_options",)),
    Format("hf", "Hugging Face safetensors file or folder", "shardkit.checkpoint.formats.hf.reader",
           "shardkit.checkpoint.formats.hf.reader", ("huggingface", "safetensors"),
           ("model.safetensors.index.json", "model.safetensors")),
    Format("torch", "torch.save file (weights_only)", "shardkit.checkpoint.formats.torchsave.reader",
           "shardkit.checkpoint.formats.torchsave.writer", ("pt", "torch.save"), (), ("torch_options",)),
    Format("dcp", "torch.distributed.checkpoint directory", "shardkit.checkpoint.formats.dcp.reader",
           "shardkit.checkpoint.formats.dcp.reader", (), (".metadata",)),
)}

WRITABLE: tuple[str, ...] = tuple(name for name, f in FORMATS.items() if f.writer)

COMMIT_MARKERS: tuple[str, ...] = tuple(m for f in FORMATS.values() for m in f.markers)


def normalize_format(name: str) -> str:
    """The canonical format name for a user's spelling (``native``, ``pt``, ``safetensors``...)."""
    lowered = name.lower()
    for f in FORMATS.values():
        if lowered == f.name or lowered in f.aliases:
            return f.name
    raise UnsupportedFormat(f"format {name!r} is unknown; use one of {', '.join(FORMATS)}")


def format_module(name: str, role: str = "reader") -> Any:
    """The ``reader`` or ``writer`` module of format ``name``."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise UnsupportedFormat(f"unknown checkpoint format {name!r}; known: {sorted(FORMATS)}")
    if getattr(fmt, role) is None:
        raise UnsupportedFormat(f"shardkit reads {name} checkpoints and does not write them; convert to one of "
                                f"{', '.join(WRITABLE)}")
    try:
        return importlib.import_module(getattr(fmt, role))
    except ImportError as exc:
        raise UnsupportedFormat(f"format {name!r} is not available in this installation ({exc})") from None


def detect_format(storage: Storage) -> str:
    """The first format that recognises ``storage`` (native first); a path with no checkpoint gets an
    error that says what is there (nothing, data without a commit, or other files)."""
    if not storage.exists():
        raise CheckpointNotFound(f"{storage.url}: no such file or directory")
    for name in FORMATS:
        try:
            module = format_module(name)
        except UnsupportedFormat:
            continue
        if module.detect(storage):
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
                format: str | None = None, **options: Any) -> CheckpointReader:
    """Open ``url`` in ``format`` (detected when ``None``): the one way every tool opens a checkpoint.

    ``options`` go to the format's reader when it takes them (``io_threads``
    for native, ``torch_options`` for torch.save).  A request the format cannot
    honour (``torch_options`` asking to trust pickles for a DCP directory) is
    refused, never silently ignored; a mere hint (``io_threads``) is dropped.
    """
    storage = url if isinstance(url, Storage) else Storage(url, storage_options)
    name = normalize_format(format) if format else detect_format(storage)
    fmt = FORMATS[name]
    given = {k: v for k, v in options.items() if v is not None}
    for key in sorted(k for k in given if k not in fmt.open_options):
        if _is_set(given[key]):
            why = getattr(given[key], "refused_for", lambda n: f"{key} does not apply to a {n} checkpoint")(name)
            raise ConfigurationError(f"{storage.url}: {why}; drop it")
    return format_module(name).open_reader(storage, **{k: v for k, v in given.items() if k in fmt.open_options})


def _is_set(value: Any) -> bool:
    """Whether an option asks for something (an object with ``is_set()``, e.g. ``TorchLoadOptions``);
    plain values are hints."""
    is_set = getattr(value, "is_set", None)
    return bool(is_set()) if callable(is_set) else False
