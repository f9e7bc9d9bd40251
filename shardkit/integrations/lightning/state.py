"""Lightning's checkpoint dict <-> what shardkit stores: sharded tensors apart, the rest as one JSON text.

Why: Lightning hands a strategy one dict holding the model's and optimizers'
tensors next to the loop's own state (epoch, global step, loop progress,
callbacks, lr schedulers, hyper-parameters).  The tensors go through
shardkit's save (sharded, resharded on load); the rest is small and is kept
as JSON text -- never pickle -- in the checkpoint's manifest (or a pointer
file), so it comes back exactly: tuples, int keys, empty dicts and the
``inf`` a ``ModelCheckpoint`` starts its scores at survive, and the few small
tensors in it (scores) are written as their values.  A value JSON cannot
hold (a custom object in ``hyper_parameters``) raises
:class:`~shardkit.errors.DataStateError` naming where it sits.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from shardkit.data.encode import decode_tree, encode_tree
from shardkit.errors import DataStateError
from shardkit.wire.json_values import encode_scalar

__all__ = ["split_checkpoint", "encode_rest", "decode_rest", "optimizer_key", "META_KEY"]

META_KEY = "lightning"  # the manifest meta entry (and pointer-file field) holding the JSON text


def optimizer_key(index: int) -> str:
    """The key optimizer ``index`` is stored under: Lightning's own (``optimizer_0``), so its DCP folders load too."""
    return f"optimizer_{index}"


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, rest)``: the model and optimizer states under Lightning's DCP keys, and everything else."""
    rest = dict(checkpoint)
    tensors: dict[str, Any] = {"state_dict": rest.pop("state_dict")}
    for index, optim_state in enumerate(rest.pop("optimizer_states", [])):
        tensors[optimizer_key(index)] = optim_state
    return tensors, rest


def encode_rest(rest: dict[str, Any], where: str) -> str:
    """The non-tensor part of a checkpoint as JSON text; small tensors in it are stored by value."""
    tree, tensors = encode_tree(rest, where)
    stored = []
    for index, tensor in enumerate(tensors):
        if tensor.numel() > 1 << 16:
            raise DataStateError(f"{where}: a tensor of {tensor.numel()} elements (tensor {index} of the loop's "
                                 f"state) is too large for the checkpoint's metadata; keep large tensors in the "
                                 f"model (a buffer) so they are saved sharded")
        values = tensor.detach().to("cpu").reshape(-1).tolist()
        stored.append({"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                       "values": [encode_scalar(v) for v in values]})
    return json.dumps({"tree": tree, "tensors": stored}, allow_nan=False, separators=(",", ":"))


def decode_rest(text: str, where: str) -> dict[str, Any]:
    """Inverse of :func:`encode_rest`; :class:`DataStateError` naming ``where`` when it is malformed."""
    try:
        doc = json.loads(text)
        tensors = [_tensor(entry) for entry in doc["tensors"]]
        rest = decode_tree(doc["tree"], tensors)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise DataStateError(f"{where}: the Lightning state stored there is malformed ({exc})") from exc
    if not isinstance(rest, dict):
        raise DataStateError(f"{where}: the Lightning state stored there is a {type(rest).__name__}, not a dict")
    return rest


def _tensor(entry: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, entry["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {entry['dtype']!r}")
    values = [float(v["$float"]) if isinstance(v, dict) else v for v in entry["values"]]
    return torch.tensor(values, dtype=dtype).reshape(entry["shape"])
