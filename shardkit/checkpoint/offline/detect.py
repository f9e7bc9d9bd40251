"""Which format is at a URL, and a reader for it, with messages a user can act on.

Detection itself is the engine's (:func:`shardkit.checkpoint.formats.detect_format`:
native first, then HF, torch.save, DCP).  This module adds what a command-line
user needs around it: a missing path is :class:`~shardkit.errors.CheckpointNotFound`;
a path that exists but is no checkpoint is :class:`~shardkit.errors.UnsupportedFormat`
saying what was found there (e.g. data files without a manifest: an
interrupted write).

It also says *which* source a run read, for resume: :func:`canonical_location`
(one spelling per place, so ``./ckpt`` and ``/abs/ckpt`` are the same source)
and :func:`source_fingerprint` (changes when the source's contents change, so
a rerun never keeps data written from an older version of SRC).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any, Mapping

from shardkit.checkpoint.formats import detect_format as engine_detect
from shardkit.checkpoint.formats import format_module
from shardkit.checkpoint.formats.base import CheckpointReader
from shardkit.checkpoint.io.storage import Storage, split_file
from shardkit.errors import CheckpointNotFound, ConfigurationError, UnsupportedFormat

if TYPE_CHECKING:
    from shardkit.checkpoint.formats.torchsave import TorchLoadOptions

__all__ = ["FORMATS", "detect", "open_source", "normalize_format", "exists", "canonical_location",
           "overlap", "source_fingerprint"]

FORMATS = ("shardkit", "hf", "torch", "dcp")
_ALIASES = {"native": "shardkit", "shardkit": "shardkit", "hf": "hf", "huggingface": "hf", "safetensors": "hf",
            "torch": "torch", "pt": "torch", "torch.save": "torch", "dcp": "dcp"}


def normalize_format(name: str) -> str:
    """The canonical format name for a user's spelling (``native``, ``pt``, ``safetensors``...)."""
    try:
        return _ALIASES[name.lower()]
    except KeyError:
        raise UnsupportedFormat(f"format {name!r} is unknown; use one of {', '.join(FORMATS)}") from None


def exists(storage: Storage) -> bool:
    """Whether anything (file or directory) is at ``storage``'s own URL (a 403 raises, not "no")."""
    return storage.exists()


def detect(storage: Storage) -> str:
    """The format at ``storage``; raises with a useful message when there is none."""
    if not exists(storage):
        raise CheckpointNotFound(f"{storage.url}: no such file or directory")
    try:
        return engine_detect(storage)
    except CheckpointNotFound:
        pass
    if storage.is_dir():
        names = storage.listdir()
        if "data" in names or any(n.endswith(".safetensors") or n.endswith(".distcp") for n in names):
            raise UnsupportedFormat(f"{storage.url}: holds data files but no manifest/index/metadata: an "
                                    "uncommitted (interrupted) checkpoint; rerun the command that wrote it") from None
        shown = (", ".join(names[:5]) + (", ..." if len(names) > 5 else "")) if names else "an empty directory"
        raise UnsupportedFormat(f"{storage.url}: not a checkpoint shardkit reads (found {shown}); expected a "
                                "shardkit checkpoint, a DCP directory, an HF safetensors folder or a torch.save "
                                "file") from None
    parent, name = split_file(storage)
    parent.read_bytes(name, 0, 8)  # an unreadable file says so (permission denied) instead of "unknown format"
    raise UnsupportedFormat(f"{storage.url}: unknown file format (neither safetensors nor a torch.save zip)") from None


def open_source(url: str, storage_options: Mapping[str, Any] | None = None, fmt: str | None = None,
                torch_options: "TorchLoadOptions | None" = None) -> CheckpointReader:
    """Open ``url`` as a :class:`CheckpointReader`, detecting the format unless ``fmt`` is given.

    ``torch_options`` apply to a torch.save source; asking another format to
    trust pickles or to take ``model_keys`` is refused rather than ignored.
    """
    storage = Storage(url, storage_options)
    fmt = normalize_format(fmt) if fmt else detect(storage)
    if fmt == "torch":
        return format_module(fmt).open_reader(storage, torch_options)
    if torch_options is not None and (torch_options.trust_pickle or torch_options.model_keys is not None):
        raise ConfigurationError(f"{url}: --trust-pickle and --model-keys apply to torch.save sources, and this is "
                                 f"a {fmt} checkpoint; drop them")
    return format_module(fmt).open_reader(storage)


def canonical_location(storage: Storage) -> str:
    """One spelling per place: symlinks and relative paths resolved locally, no trailing slash remotely.

    Remotely the endpoint is part of the place: ``s3://ckpts/run`` on two
    S3-compatible services are two places (a migration between them is fine).
    """
    if storage.is_local:
        return "file://" + os.path.realpath(storage.root)
    protocol = storage.fs.protocol if isinstance(storage.fs.protocol, str) else storage.fs.protocol[0]
    opts = storage.storage_options
    endpoint = (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                or opts.get("project") or "")
    return f"{protocol}://{storage.root.rstrip('/')}" + (f"@{endpoint}" if endpoint else "")


def overlap(a: Storage, b: Storage) -> bool:
    """Whether ``a`` and ``b`` are the same place or one lies inside the other."""
    x, y = canonical_location(a), canonical_location(b)
    x_path, _, x_end = x.partition("@")
    y_path, _, y_end = y.partition("@")
    if x_end != y_end:
        return False
    return (x_path == y_path or x_path.startswith(y_path.rstrip("/") + "/")
            or y_path.startswith(x_path.rstrip("/") + "/"))


def _stamp(info: Mapping[str, Any]) -> str:
    """What changes when an object is rewritten: its ETag/generation remotely, else its mtime."""
    for key in ("ETag", "etag", "generation", "md5Hash", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return ""


def _local_stamp(st: os.stat_result) -> str:
    # inode and ctime too: a file replaced by rename, or rewritten within one mtime tick, still differs
    return f"ino={st.st_ino},mtime_ns={st.st_mtime_ns},ctime_ns={st.st_ctime_ns}"


def _listing(storage: Storage) -> list[tuple[str, int, str]]:
    """(name, size, change stamp) of the files directly at ``storage`` (or of the file itself)."""
    if storage.is_local:
        if not os.path.isdir(storage.root):
            st = os.stat(storage.root)
            return [(os.path.basename(storage.root), st.st_size, _local_stamp(st))]
        out = []
        with os.scandir(storage.root) as entries:
            for e in entries:
                if e.is_file():
                    st = e.stat()
                    out.append((e.name, st.st_size, _local_stamp(st)))
        return sorted(out)
    try:
        storage.fs.invalidate_cache(storage.root)
    except Exception:  # noqa: BLE001 - not every filesystem caches listings
        pass
    if storage.is_dir():
        infos = storage.retry(f"listing {storage.url}", lambda: storage.fs.ls(storage.root, detail=True))
    else:
        infos = [storage.retry(f"checking {storage.url}", lambda: storage.fs.info(storage.root))]
    return sorted((str(i["name"]).rstrip("/").rsplit("/", 1)[-1], int(i.get("size") or 0), _stamp(i))
                  for i in infos if i.get("type", "file") == "file")


def source_fingerprint(storage: Storage, fmt: str) -> str:
    """A digest that changes whenever the checkpoint at ``storage`` changes.

    A native checkpoint is pinned by its manifest (which holds every chunk's
    crc32c), so the manifest's bytes are hashed.  Other formats record no
    checksums, so their files' names, sizes and change stamps (mtime locally,
    ETag/generation on object stores) stand in: a file replaced in place with
    the same shapes but new values still changes the digest.
    """
    digest = hashlib.sha256(fmt.encode())
    if fmt == "shardkit":
        digest.update(storage.read_bytes("manifest.json"))
    else:
        digest.update(json.dumps(_listing(storage)).encode())
    return digest.hexdigest()[:16]
