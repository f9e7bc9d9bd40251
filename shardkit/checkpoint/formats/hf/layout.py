"""The names in a Hugging Face folder and what they mean to ``from_pretrained``.

Which file commits the folder's weights (:func:`weights_file`), which weight
files an interrupted or superseded export left beside them
(:func:`export_files`), and whether the config ties the output head to the
input embeddings (:func:`ties_word_embeddings`).  The reader, the writer,
``--overwrite`` and ``diff`` all decide by these, so they agree with
transformers and with each other.
"""

from __future__ import annotations

import json
import re
from typing import Any, Collection, Mapping

from shardkit.checkpoint.io.storage import Storage

__all__ = ["INDEX_NAME", "SINGLE_NAME", "CONFIG_NAME", "HEAD_KEY", "weights_file", "export_files", "is_head",
           "ties_word_embeddings"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
HEAD_KEY = "lm_head.weight"  # the output head save_pretrained leaves out of a tied model's files
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
    left = {n for n in names if _SHARD_NAME.match(n) or n.startswith(Storage.temporary_name_prefix(SINGLE_NAME))}
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


def is_head(fqn: str) -> bool:
    """Whether ``model.<key>`` is an output head ``save_pretrained`` leaves out when the config ties word
    embeddings (``lm_head.weight``, the key of ``_tied_weights_keys`` in every ``*ForCausalLM``)."""
    key = fqn[len("model."):] if fqn.startswith("model.") else ""
    return key == HEAD_KEY or key.endswith("." + HEAD_KEY)


def ties_word_embeddings(config: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` makes ``from_pretrained`` tie the output head to the input embeddings.

    Only an explicit ``"tie_word_embeddings": true`` says so.  An absent field
    means the model class's own default, which differs by model: transformers 5
    has none in ``PretrainedConfig`` (``PreTrainedModel.get_expanded_tied_weights_keys``
    reads ``getattr(config, "tie_word_embeddings", False)``) and gives
    ``LlamaConfig`` false, ``GPT2Config`` true; transformers 4's
    ``PretrainedConfig`` defaulted to true, overridden to false by e.g.
    ``LlamaConfig``.  ``save_pretrained`` of transformers 5 always writes the
    field.  Unsure, a head is written in full (an extra copy of a tied key loads
    fine) and not taken as tied by ``diff``.
    """
    return config.get("tie_word_embeddings") is True
