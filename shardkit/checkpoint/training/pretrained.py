"""Pretrained weights into a model built on the meta device: :func:`load_pretrained`.

Meta init, ``fully_shard``, ``to_empty`` and :func:`~shardkit.checkpoint.load`
already do the heavy part (each rank reads only its shards' byte ranges of
an HF folder).  What users get wrong around them is what this module does:

* finding the weights in the Hugging Face hub cache: a repo id or a
  ``models--org--name`` folder resolves through ``refs/<revision>`` to
  ``snapshots/<commit>/`` (:func:`resolve_pretrained`), as ``from_pretrained``
  resolves it offline -- no download is ever made;
* naming: a checkpoint key ``k`` is the model's key ``key_map(k)``, so a
  checkpoint of ``LlamaForCausalLM`` loads into a bare ``LlamaModel``;
* the non-persistent buffers (a rotary embedding's ``inv_freq``): no
  checkpoint holds them and ``to_empty`` leaves them uninitialised, so a
  model built on ``meta`` runs on garbage without failing.  They are
  recomputed (:func:`recompute_buffers`) or, when shardkit cannot know how,
  the load refuses before reading a byte, naming them.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping

import torch
from torch import nn

from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.training.load import load
from shardkit.errors import CheckpointNotFound, ConfigurationError

__all__ = ["load_pretrained", "resolve_pretrained", "recompute_buffers", "non_persistent_buffers", "hub_cache_dir"]

log = logging.getLogger(__name__)


def hub_cache_dir() -> str:
    """The Hugging Face hub cache, where ``huggingface_hub`` looks: ``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def _is_repo_cache(storage: Storage) -> bool:
    return storage.is_dir("refs") and storage.is_dir("snapshots")


def resolve_pretrained(path: str | os.PathLike, *, revision: str = "main", cache_dir: str | None = None,
                       storage_options: Mapping[str, Any] | None = None) -> str:
    """The folder holding the weights ``path`` names, as ``from_pretrained`` would find it offline.

    ``path`` is a folder of weights (a ``save_pretrained`` output, or a
    hub snapshot ``.../snapshots/<commit>``), a hub repo cache folder
    (``models--org--name``: its ``refs/<revision>`` names the snapshot; a
    full commit hash as ``revision`` names one directly), or a repo id
    (``org/name``) that is not a local path, looked up in ``cache_dir``
    (default :func:`hub_cache_dir`).  Nothing is downloaded: a repo that is
    not in the cache raises :class:`CheckpointNotFound` saying how to get it.
    """
    url = os.fspath(path)
    storage = Storage(url, storage_options)
    if not storage.exists():
        parts = url.split("/")
        if "://" in url or len(parts) != 2 or not all(parts):
            raise CheckpointNotFound(f"{url}: no such folder of pretrained weights (nor a repo id org/name)")
        cache = cache_dir or hub_cache_dir()
        url = os.path.join(cache, "models--" + "--".join(parts))
        storage = Storage(url, storage_options)
        if not storage.exists():
            raise CheckpointNotFound(f"{path!s} is not in the Hugging Face cache {cache} (no {url}); download it "
                                     f"first (hf download {path!s}) or pass its folder")
    if not _is_repo_cache(storage):
        return url
    snapshots = storage.child("snapshots")
    refs = storage.child("refs")
    if refs.exists(revision) and not refs.is_dir(revision):
        commit = refs.read_bytes(revision).decode("utf-8", "replace").strip()
        where = f"{refs.where(revision)} names commit {commit!r}"
    else:
        commit, where = revision, f"revision {revision!r} (no {refs.where(revision)})"
    if not commit or "/" in commit or not snapshots.is_dir(commit):
        have = ", ".join(sorted(snapshots.listdir())) or "none"
        raise CheckpointNotFound(f"{where}, but {snapshots.where(commit or '?')} is not there (snapshots: {have}); "
                                 "download that revision first or pass revision=")
    log.info("%s at %s is snapshot %s", url, revision, commit)
    return snapshots.where(commit)


def non_persistent_buffers(model: nn.Module) -> list[str]:
    """The FQNs of ``model``'s buffers that its ``state_dict`` leaves out (registered with
    ``persistent=False``): what no checkpoint holds and ``to_empty`` leaves uninitialised."""
    saved = set(model.state_dict(keep_vars=True))
    return [name for name, _ in model.named_buffers(remove_duplicate=False) if name not in saved]


def _owner(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    prefix, _, name = fqn.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), name


def _rebuildable(module: nn.Module) -> bool:
    """A module holding no parameters of its own and built from a ``config`` (every Hugging Face rotary
    embedding of transformers 4.4x and 5): a fresh one on the CPU is cheap and computes the buffers."""
    return getattr(module, "config", None) is not None and next(module.parameters(recurse=False), None) is None


def recompute_buffers(model: nn.Module) -> list[str]:
    """Recompute every non-persistent buffer of ``model`` in place; return their FQNs.

    A buffer's module is built again on the CPU from its ``config``
    (``type(module)(module.config)``, which is how transformers' rotary
    embeddings compute ``inv_freq``) and its buffers copied in, keeping the
    model's dtype and device.  A buffer whose module is not built that way
    raises :class:`ConfigurationError` naming it, before anything is written:
    pass ``init_buffers=`` to :func:`load_pretrained` to recompute it yourself.
    """
    names = non_persistent_buffers(model)
    owners: dict[str, tuple[nn.Module, list[tuple[str, str]]]] = {}
    unknown = []
    for fqn in names:
        module, name = _owner(model, fqn)
        if _rebuildable(module):
            owners.setdefault(fqn.rpartition(".")[0], (module, []))[1].append((fqn, name))
        else:
            unknown.append(fqn)
    if unknown:
        raise ConfigurationError(
            f"non-persistent buffer(s) {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}: no checkpoint "
            "holds them, to_empty() leaves them uninitialised, and shardkit cannot tell how to compute them; pass "
            "init_buffers=fn, a function of the model that recomputes them (init_buffers=lambda model: None when "
            "your code already does)")
    for module, buffers in owners.values():
        with torch.device("cpu"):
            fresh = type(module)(module.config)
        for fqn, name in buffers:
            value, target = getattr(fresh, name, None), getattr(module, name)
            if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                raise ConfigurationError(f"{fqn}: a {type(module).__name__} built again from its config holds "
                                         f"{'no such buffer' if value is None else tuple(value.shape)}, not "
                                         f"{tuple(target.shape)}; pass init_buffers= to compute it yourself")
            with torch.no_grad():
                target.copy_(value)
    return names


def load_pretrained(model: nn.Module, path: str | os.PathLike, *, revision: str = "main",
                    cache_dir: str | None = None, key_map: Callable[[str], str] | None = None,
                    init_buffers: Callable[[nn.Module], Any] | None = None, strict: bool = True,
                    dtype_cast: bool = False, storage_options: Mapping[str, Any] | None = None,
                    process_group: Any = None) -> str:
    """Load pretrained weights (an HF folder, a hub snapshot or repo id) into ``model`` in place; return
    the folder read.

    Collective: every rank calls it.  ``model`` is the model after
    ``fully_shard`` and ``to_empty`` (or any model: plain parameters load
    whole); each rank reads only the byte ranges of its own shards.  The
    folder is found by :func:`resolve_pretrained` (``revision``,
    ``cache_dir``).  ``key_map`` maps a key of ``model.state_dict()`` to the
    checkpoint's (e.g. ``lambda k: "model." + k`` to load a
    ``*ForCausalLM`` checkpoint into its bare base model).  Then the
    non-persistent buffers are recomputed: by ``init_buffers(model)`` when
    given, else by :func:`recompute_buffers`, which refuses -- before any
    byte is read -- a buffer it cannot compute.  ``strict``, ``dtype_cast``,
    ``storage_options`` and ``process_group`` are :func:`~shardkit.checkpoint.load`'s.
    """
    url = resolve_pretrained(path, revision=revision, cache_dir=cache_dir, storage_options=storage_options)
    if init_buffers is None:
        recompute_buffers(model)  # first: a buffer it cannot compute fails before the load reads anything
    state = model.state_dict()
    if key_map is not None:
        mapped: dict[str, Any] = {}
        for key, value in state.items():
            new = key_map(key)
            if not isinstance(new, str) or new in mapped:
                raise ConfigurationError(f"key_map({key!r}) gave {new!r}: "
                                         f"{'not a string' if not isinstance(new, str) else 'a key taken already'}")
            mapped[new] = value
        state = mapped
    load({"model": state}, url, strict=strict, dtype_cast=dtype_cast, storage_options=storage_options,
         process_group=process_group)
    if init_buffers is not None:
        init_buffers(model)
    return url
