"""The names in a Hugging Face folder and what they mean to ``from_pretrained``.

Which file commits the folder's weights (:func:`weights_file`), and which
weight files an interrupted or superseded export left beside them
(:func:`export_files`).  The reader, the writer and ``--overwrite`` all
decide by these, so they agree with transformers and with each other.
"""

from __future__ import annotations

import json
import re
from typing import Collection

from shardkit.checkpoint.io.files import temporary_name_prefix
from shardkit.checkpoint.io.storage import Storage

__all__ = ["INDEX_NAME", "SINGLE_NAME", "weights_file", "export_files"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# how write_hf names shards: save_pretrained's names, with a suffix while an old export still uses them
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}(-[0-9a-f]{8})?\.safetensors$")


def weights_file(folder: Storage) -> str | None:
    """The file that says which weights HF folder ``folder`` holds: ``model.safetensors`` when it is
    there -- even beside an index, which is then not read -- else ``model.safetensors.index.json``;
    ``None`` when neither is.

    This is the order ``from_pretrained`` looks in (transformers'
    ``modeling_utils._get_resolved_checkpoint_files``: the single file first,
    the index only when there is none), so shardkit's reader, ``verify`` and
    ``inspect`` see the weights transformers loads, and an export killed
    between its commit and its cleanup is one checkpoint to both.
    """
    if folder.exists(SINGLE_NAME):
        return SINGLE_NAME
    return INDEX_NAME if folder.exists(INDEX_NAME) else None


def export_files(folder: Storage) -> tuple[set[str], set[str]]:
    """(the weight files of the checkpoint in HF folder ``folder``; the weight files beside them that no
    reader loads): an index and its shards that ``model.safetensors`` shadows (:func:`weights_file`),
    shards no index names, and ``model.safetensors`` streamed under a temporary name -- what an
    interrupted or superseded export of :func:`write_hf` left."""
    names = set(folder.listdir())
    committed = weights_file(folder)
    live = {SINGLE_NAME} if committed == SINGLE_NAME else \
        {INDEX_NAME} | _index_shards(folder, names) if committed == INDEX_NAME else set()
    left = {n for n in names if _SHARD_NAME.match(n) or n.startswith(temporary_name_prefix(SINGLE_NAME))}
    if committed == SINGLE_NAME and INDEX_NAME in names:
        left |= {INDEX_NAME} | _index_shards(folder, names)
    return live, left - live


def _index_shards(folder: Storage, names: Collection[str]) -> set[str]:
    """The files in ``names`` that the folder's index names (none when it is not a valid index)."""
    try:
        weight_map = json.loads(folder.read_bytes(INDEX_NAME)).get("weight_map", {})
        return {v for v in weight_map.values() if isinstance(v, str) and v in names}
    except (ValueError, AttributeError, UnicodeDecodeError):
        return set()
