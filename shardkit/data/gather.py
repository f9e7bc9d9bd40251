"""All-gather each rank's input state as JSON plus raw tensor bytes (no pickle).

Why every rank gets every rank's state: the checkpoint writes a plain tensor
once (from the lowest rank holding it) and its JSON values from rank 0, as
for any replicated entry.  When per-rank states (RNG, a per-rank loader) are
already present on every rank under ``rank<r>`` keys, the checkpoint needs no
special path for them -- and a global state can be checked for agreement
across ranks on the way.

``torch.distributed.all_gather_object`` would pickle; here each rank packs
``[8-byte header length][UTF-8 JSON header][tensor bytes...]`` into one
``uint8`` tensor that :func:`shardkit.wire.collectives.all_gather_bytes` gathers
(lengths first, payloads zero-padded to the longest).  Per-rank input state is kilobytes, so the padding is cheap.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from shardkit.data.encode import decode_tree, encode_tree
from shardkit.errors import DataStateError
from shardkit.wire.collectives import all_gather_bytes

__all__ = ["all_gather_trees"]


def _pack(value: Any, where: str) -> torch.Tensor:
    tree, tensors = encode_tree(value, where)
    flats = [t.detach().to("cpu").reshape(-1).clone().view(torch.uint8) for t in tensors]
    header = {"tree": tree,
              "tensors": [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "nbytes": f.numel()}
                          for t, f in zip(tensors, flats)]}
    text = json.dumps(header, allow_nan=False, separators=(",", ":")).encode("utf-8")
    length = torch.tensor([len(text)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([length, torch.frombuffer(bytearray(text), dtype=torch.uint8), *flats])


def _unpack(payload: torch.Tensor, where: str) -> Any:
    payload = payload.to("cpu")
    length = int(payload[:8].clone().view(torch.int64).item())
    header = json.loads(payload[8:8 + length].numpy().tobytes().decode("utf-8"))  # one copy, not a call per byte
    offset = 8 + length
    tensors = []
    for spec in header["tensors"]:
        dtype = getattr(torch, spec["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise DataStateError(f"{where}: unknown tensor dtype {spec['dtype']!r} in a gathered state")
        raw = payload[offset:offset + spec["nbytes"]].clone()
        offset += spec["nbytes"]
        tensors.append(raw.view(dtype).reshape(spec["shape"]))
    return decode_tree(header["tree"], tensors)


def all_gather_trees(value: Any, where: str, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (dicts, lists, JSON scalars, tensors), indexed by rank in ``group``.

    Collective over ``group`` when a process group exists; without one it
    returns ``[copy of value]``.  Tensors come back as fresh CPU copies, so
    the result is a snapshot that later training steps cannot change.
    """
    payload = _pack(value, where)
    gathered = all_gather_bytes(payload, group)
    return [_unpack(g, where if len(gathered) == 1 else f"{where} of rank {r}") for r, g in enumerate(gathered)]
