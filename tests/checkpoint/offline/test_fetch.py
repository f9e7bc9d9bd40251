"""The fetcher reuses its per-thread buffers: fresh allocations per box run at page-fault speed here."""

from __future__ import annotations

import torch


def test_a_cast_reuses_one_buffer_per_thread():
    from shardkit.checkpoint.formats.base import (
        CheckpointInfo,
        CheckpointReader,
        StoredChunk,
        TensorEntry,
    )
    from shardkit.checkpoint.offline.fetch import Fetcher

    class Ones(CheckpointReader):
        def __init__(self):
            super().__init__()
            self.info = CheckpointInfo("test", "test://")

        def tensors(self):
            return {"model.w": TensorEntry("model.w", torch.float32, (64, 8), (StoredChunk((0, 0), (64, 8), None),))}

        def values(self):
            return {}

        def read(self, requests):
            for r in requests:
                r.out.fill_(1.5)

    fetch = Fetcher(Ones(), {"model.w": torch.bfloat16}, reuse=True)
    first = fetch("model.w", (0, 0), (32, 8))
    second = fetch("model.w", (32, 0), (16, 8))
    assert first.dtype == second.dtype == torch.bfloat16 and bool((second == 1.5).all())
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
