"""torchtitan's Hugging Face options on shardkit: the last save as an HF folder, and an initial load from one.

``last_save_in_hf``: torchtitan writes the final model through DCP's
``HuggingFaceStorageWriter`` and, with a sharded index, consolidates on every
rank.  Here the model (renamed by torchtitan's state-dict adapter, cast to
``export_dtype``) is saved as a shardkit checkpoint beside the step, then rank 0
converts it with shardkit's HF export (``convert(..., to=hf)``: shards up to
5 GB, ``model.safetensors.index.json`` when there are several, the config and
tokenizer files of ``hf_assets_path``) into ``step-N``, and removes the
intermediate.  The index (or the single file) is the commit, so a crash half
way never leaves a ``step-N`` that looks whole.

``initial_load_in_hf``: shardkit's ``load`` reads an HF folder in place (each
rank only the bytes of its shards) into the adapter's HF-named view of the
model, which the adapter turns back into torchtitan's names.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import torch

import shardkit.checkpoint as skc
from shardkit.checkpoint.formats import handler_for
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.names import split_url
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import error_record, from_record
from shardkit.integrations.torchtitan.state import MODEL_KEY, cast_floating
from shardkit.wire.collectives import all_gather_json

__all__ = ["HF_FORMAT", "export_hf", "load_hf"]

log = logging.getLogger(__name__)

HF_FORMAT = handler_for("safetensors").name  # the registry's name of the Hugging Face format


def export_hf(model_state: Mapping[str, Any], url: str, sd_adapter: Any, dtype: torch.dtype,
              storage_options: Mapping[str, Any] | None = None) -> None:
    """Write ``model_state`` (torchtitan names) at ``url`` as a Hugging Face folder (collective)."""
    hf_state = cast_floating(sd_adapter.to_hf(dict(model_state)), dtype)
    parent, name = split_url(url)
    staging = f"{parent}/.{name}.shardkit-export"  # not a step-N name: never taken for a step
    skc.save({MODEL_KEY: hf_state}, staging, storage_options=storage_options)
    error: BaseException | None = None
    if Dist().rank == 0:
        try:
            assets = getattr(sd_adapter, "hf_assets_path", None)
            has_config = bool(assets) and os.path.isfile(os.path.join(assets, "config.json"))
            config = assets if has_config else None
            skc.convert(staging, url, to=HF_FORMAT, overwrite=True, config=config,
                        storage_options=dict(storage_options or {}) or None)
            log.info("exported the model as a Hugging Face folder at %s (%s)", url, dtype)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it below, then raises it
            error = exc
        finally:
            Storage(staging, storage_options).delete_tree()
    reported = all_gather_json(error_record(error) if error is not None else None)[0]
    if error is not None:
        raise error
    if reported is not None:
        raise from_record(reported, f"exporting {url} as a Hugging Face folder failed on rank 0: "
                                    f"{reported['message']}")


def load_hf(model_wrapper: Any, url: str, sd_adapter: Any,
            storage_options: Mapping[str, Any] | None = None) -> None:
    """Load the Hugging Face folder at ``url`` into the model through torchtitan's adapter (collective)."""
    hf_state = sd_adapter.to_hf(model_wrapper.state_dict())
    target = {MODEL_KEY: hf_state}
    skc.load(target, url, storage_options=storage_options, dtype_cast=True)
    model_wrapper.load_state_dict(sd_adapter.from_hf(target[MODEL_KEY]))
