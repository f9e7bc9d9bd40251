"""``convert --to hf``: which keys the folder gets, and the config and tokenizer files beside them.

A folder ``from_pretrained`` can load needs three things the weights alone do
not give:

* **Side files.**  ``config.json``, the tokenizer files and
  ``generation_config.json``.  They come from the source (an HF folder's own,
  or those a shardkit checkpoint converted from one keeps under ``extra/``)
  and from ``--config FILE_OR_DIR``: a directory gives every side file it
  holds (the same allowlist as an HF source, see
  :func:`~shardkit.checkpoint.formats.hf.reader.side_file_problem`) and must hold a
  ``config.json``; a file is taken as ``config.json``.  A file ``--config``
  gives replaces the source's file of the same name; the source's others stay.
* **Tied weights written as HF writes them.**  ``save_pretrained`` of a model
  with ``tie_word_embeddings`` leaves the output head out (``lm_head.weight``,
  the key of ``_tied_weights_keys`` in every ``*ForCausalLM``): loading ties
  it to the embedding again.  So when ``config.json`` ties word embeddings
  (``"tie_word_embeddings": true``; an absent field means the model class's
  default, see :func:`~shardkit.checkpoint.formats.hf.layout.ties_word_embeddings`)
  and the checkpoint
  ties a ``lm_head.weight`` to another key, the head is left out.  Any other
  tied key, or any tie when the config does not tie or there is no config, is
  written with its data: an extra copy of a key a model ties is harmless to
  ``from_pretrained``, a missing key it does not tie is not.
* **The dtype in the config.**  With ``--dtype``, ``torch_dtype`` and
  ``dtype`` (the name newer ``transformers`` read) in the written
  ``config.json`` say the new dtype (both are written when it has neither),
  so ``from_pretrained(dtype="auto")`` loads what is on disk.  Otherwise the
  config is copied byte for byte.

All of it is read and checked before DST is touched: a missing ``--config``,
a directory without ``config.json``, or a ``config.json`` that is not a JSON
object is one :class:`~shardkit.errors.ConfigurationError` naming the path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from shardkit.checkpoint.formats.hf.layout import CONFIG_NAME, is_head, ties_word_embeddings
from shardkit.checkpoint.formats.hf.reader import SIDE_FILE_CAP, side_files_in
from shardkit.checkpoint.io.names import check_name
from shardkit.checkpoint.io.storage import Storage, split_file
from shardkit.checkpoint.offline.select import Selection, parse_dtype
from shardkit.checkpoint.offline.side_files import copy_files, side_files_of
from shardkit.errors import ConfigurationError, UnsafeCheckpoint

__all__ = ["HfExport", "plan_hf_export"]

_DTYPE_KEYS = ("torch_dtype", "dtype")


@dataclass
class HfExport:
    """What ``convert --to hf`` writes beside the selection's weights, decided before DST is touched."""

    selection: Selection  # what to write: the conversion's selection less the tied keys left out
    side_files: dict[str, tuple[Storage, str]] = field(default_factory=dict)  # target name -> (folder, name)
    config: bytes | None = None  # config.json to write instead of copying it (a rewritten dtype)
    notes: list[str] = field(default_factory=list)  # what the user should know: tied keys left out

    def write_side_files(self, dst: Storage) -> list[str]:
        """Copy the side files to ``dst`` (``config.json`` rewritten when the dtype changed)."""
        copies = [(folder, name, target) for target, (folder, name) in sorted(self.side_files.items())
                  if not (target == CONFIG_NAME and self.config is not None)]
        written = copy_files(copies, dst, fsync=dst.fsync_worthwhile)
        if self.config is not None:
            dst.write_stream(CONFIG_NAME, lambda f: f.write(self.config), fsync=dst.fsync_worthwhile)
            written.append(CONFIG_NAME)
        return written


def _config_files(config: str) -> dict[str, tuple[Storage, str]]:
    """``--config``: a directory's side files (with a ``config.json``), or one file taken as ``config.json``."""
    storage = Storage(config)
    if not storage.exists():
        raise ConfigurationError(f"--config {config}: no such file or directory")
    if storage.is_dir():
        names, _ = side_files_in(storage)
        if CONFIG_NAME not in names:
            raise ConfigurationError(f"--config {config}: the directory holds no {CONFIG_NAME}; name the directory "
                                     "a model was saved to with save_pretrained, or the config file itself")
        return {n: (storage, n) for n in names}
    parent, name = split_file(storage)
    try:
        check_name(name)
    except UnsafeCheckpoint:
        raise ConfigurationError(f"--config {config}: the file name has characters shardkit does not read files "
                                 "by (spaces, brackets...); copy it to config.json and name that") from None
    size = parent.size(name)
    if size > SIDE_FILE_CAP:
        raise ConfigurationError(f"--config {config}: {size} bytes, over the {SIDE_FILE_CAP >> 20} MiB a config "
                                 "file may have; name the model's config.json")
    return {CONFIG_NAME: (parent, name)}


def _read_config(folder: Storage, name: str, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(folder.read_bytes(name))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigurationError(f"{where}: not valid JSON ({exc}); a config.json is needed to export tied "
                                 "weights and dtypes the way from_pretrained reads them") from None
    if not isinstance(doc, dict):
        raise ConfigurationError(f"{where}: not a JSON object (a {type(doc).__name__}); expected a model config")
    return doc


def plan_hf_export(source: Any, sel: Selection, config: str | None, dtype: str | None) -> HfExport:
    """Side files, tied keys and the config's dtype for an HF export of ``sel`` from ``source``."""
    folder, names = side_files_of(source)
    side = {n.rsplit("/", 1)[-1]: (folder, n) for n in names} if folder is not None else {}
    if config is not None:
        side.update(_config_files(config))
    want = parse_dtype(dtype)
    cfg = None
    # a carried config is only read when something depends on it: a source whose config.json was never
    # parsed before still converts; one given with --config is always checked
    if CONFIG_NAME in side and (config is not None or sel.aliases or want is not None):
        cfg_folder, cfg_name = side[CONFIG_NAME]
        cfg = _read_config(cfg_folder, cfg_name, cfg_folder.where(cfg_name))
    left_out: dict[str, str] = {}
    if cfg is not None and ties_word_embeddings(cfg):
        for alias, target in sel.aliases.items():
            if is_head(alias):
                left_out[alias] = target
            elif is_head(target):
                left_out[target] = alias
    notes = [f"note: {head[len('model.'):]} not written: config.json ties word embeddings, so from_pretrained "
             f"ties it to {kept[len('model.'):]} (as save_pretrained writes it)" for head, kept in left_out.items()]
    kept = Selection([t for t in sel.tensors if t.name not in left_out], sel.values, sel.dropped + list(left_out),
                     {a: t for a, t in sel.aliases.items() if a not in left_out and t not in left_out})
    export = HfExport(kept, side, None, notes)
    if cfg is not None and want is not None:
        name = str(want).replace("torch.", "")
        for key in [k for k in _DTYPE_KEYS if k in cfg] or _DTYPE_KEYS:
            cfg[key] = name
        export.config = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
    return export
