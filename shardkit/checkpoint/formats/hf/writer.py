"""Writing Hugging Face safetensors checkpoints the way ``save_pretrained`` does.

The conventions ``transformers``/``huggingface_hub`` use: shards filled
greedily in key order up to ``max_shard_size`` (a tensor larger than the cap
gets a shard of its own); one shard is ``model.safetensors`` with no index,
as ``save_pretrained`` writes it, several are named
``model-0000k-of-0000N.safetensors`` beside a ``model.safetensors.index.json``
with ``metadata.total_size``; ``__metadata__ = {"format": "pt"}`` in every
header.  Each shard is streamed: its header is computed from the plan, then
rows are appended block by block.

HF holds model weights only (an HF key ``k`` is the model tensor ``model.k``),
so writing anything else is refused up front (:func:`check_tensors`) rather
than given a mangled name.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Any, Callable, Collection, Iterable

import torch

from shardkit.checkpoint.formats.dtypes import as_bytes, dtype_to_code, itemsize
from shardkit.checkpoint.formats.hf.layout import INDEX_NAME, SINGLE_NAME
from shardkit.checkpoint.formats.safetensors import SafetensorsStreamWriter
from shardkit.checkpoint.geometry.rows import iter_row_blocks, rows_per_block
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ConfigurationError, UnsupportedFormat

__all__ = ["write_hf", "plan_shards", "check_tensors"]


def check_tensors(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
    """Refuse, before anything is written, what an HF folder cannot hold: keys outside ``model.``
    (HF holds model weights only, keyed without the prefix) and dtypes safetensors has no code for."""
    for fqn, dtype, _ in tensors:
        if not fqn.startswith("model."):
            raise ConfigurationError(f"{fqn!r} is not a model tensor (no 'model.' prefix), so it has no HF name; "
                                     "keep the 'model.' prefix in --rename, or exclude it")
        try:
            dtype_to_code(dtype)
        except UnsupportedFormat:
            raise UnsupportedFormat(f"{fqn!r} is {dtype}, which safetensors cannot hold; exclude it or cast it "
                                    "with --dtype") from None


def plan_shards(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_size: int) -> list[list[int]]:
    """Greedy in key order, like ``split_state_dict_into_shards_factory``: indices per shard."""
    shards: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (_, dtype, shape) in enumerate(tensors):
        n = math.prod(shape) * itemsize(dtype)
        if current and size + n > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


Fetch = Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor]


def write_hf(dst: Storage, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], fetch: Fetch, *,
             block_bytes: int, max_shard_size: int, on_bytes: Callable[[int], None] = lambda n: None,
             before_index: Callable[[], None] = lambda: None, avoid: Collection[str] = ()) -> list[str]:
    """Write model tensors (``model.<key>`` → ``<key>``) as ``save_pretrained`` does; return the file names.

    One shard is ``model.safetensors`` and no index; several are
    ``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json``.
    ``fetch(fqn, offsets, shape)`` returns a box of rows; each shard is streamed
    (header first) a block of at most ``block_bytes`` at a time.  What makes the
    folder a checkpoint comes last (after ``before_index``, which copies side
    files), so a failure leaves none: the index, or the single file, written
    under a temporary name and moved into place.  Shards never take a name in
    ``avoid`` (the files of an export being replaced, still in use until this
    commit): the usual ``model-0000k-of-0000N.safetensors`` then gets a short
    suffix, and the index names the files as written.

    Replacing an export, the commit is the moment both shardkit and
    ``from_pretrained`` switch to the new one
    (:func:`~shardkit.checkpoint.formats.hf.layout.weights_file`): a single
    file replaces an old ``model.safetensors`` in the one step of its move,
    and shadows an old index from then on (the caller removes it after);
    several shards commit when an old ``model.safetensors`` (in ``avoid``) is
    removed, right after the new index is in place -- until then it shadows
    the new index.
    """
    check_tensors(tensors)
    items = [(fqn[len("model."):], dtype, shape) for fqn, dtype, shape in tensors]
    shards = plan_shards(items, max_shard_size)
    if len(shards) == 1:
        _write_single_file(dst, tensors, items, fetch, block_bytes, on_bytes, before_index)
        return [SINGLE_NAME]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    if set(names) & set(avoid):
        suffix = uuid.uuid4().hex[:8]
        names = [f"{n[:-len('.safetensors')]}-{suffix}.safetensors" for n in names]
    weight_map: dict[str, str] = {}
    for name, idx in zip(names, shards):
        dst.write_stream(name, _shard_producer(tensors, items, idx, fetch, block_bytes, on_bytes),
                         fsync=dst.fsync_worthwhile)  # durable before the index commits it
        for i in idx:
            weight_map[items[i][0]] = name
    total = sum(math.prod(s) * itemsize(d) for _, d, s in items)
    before_index()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    dst.put_atomic(INDEX_NAME, json.dumps(index, indent=2).encode())
    if SINGLE_NAME in avoid:
        dst.delete([SINGLE_NAME])  # the commit: the new index is what every reader follows now
    return names + [INDEX_NAME]


def _write_single_file(dst: Storage, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                       items: list[tuple[str, torch.dtype, tuple[int, ...]]], fetch: Fetch, block_bytes: int,
                       on_bytes: Callable[[int], None], before_index: Callable[[], None]) -> None:
    """``model.safetensors``, its own commit marker: streamed to a temporary name beside it, then moved
    into place -- a rename on local disks, a server-side copy on object stores, which replaces an old
    ``model.safetensors`` only once complete."""
    dst.write_then_replace(SINGLE_NAME, _shard_producer(tensors, items, list(range(len(items))), fetch,
                                                        block_bytes, on_bytes), before_index)


def _shard_producer(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                    items: list[tuple[str, torch.dtype, tuple[int, ...]]], idx: list[int], fetch: Fetch,
                    block_bytes: int, on_bytes: Callable[[int], None]) -> Callable[[Any], None]:
    """What streams the tensors ``idx`` into one safetensors file: the header from the plan, then the rows."""
    entries = [(key, dtype_to_code(dtype), shape, math.prod(shape) * itemsize(dtype))
               for key, dtype, shape in (items[i] for i in idx)]

    def produce(out: Any) -> None:
        stream = SafetensorsStreamWriter(out, entries, {"format": "pt"}, block_size=1 << 30)
        for i in idx:
            fqn, dtype, shape = tensors[i]
            key = items[i][0]
            if not shape:
                stream.write(key, as_bytes(fetch(fqn, (), ()).contiguous()))
                continue
            for r0, r1 in iter_row_blocks(shape[0], rows_per_block(dtype, shape, block_bytes)):
                block = fetch(fqn, (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])).contiguous()
                stream.write(key, as_bytes(block) if block.numel() else torch.empty(0, dtype=torch.uint8))
                on_bytes(block.numel() * block.element_size())
        stream.finish()

    return produce
