"""Checkpoints saved without tensor parallelism (plain FSDP at 3 ranks by torch's and by shardkit's
``fully_shard``, one process with plain tensors) load into (dp=2, tp=2): bitwise model and AdamW state, and
5 more steps matching each writer's uninterrupted run.

The rest of tests/test_checkpoint_2d_to_2d.py, in its own file to keep each file short.
"""

from __future__ import annotations

import pytest

from tests.checkpoint_2d_helpers import mismatches, rel_close, resume, run_layout, train_save_continue

READER = ("torch", "dp2tp2")
WRITERS = [
    ("torch", "fsdp3"),
    ("shardkit", "fsdp3"),
    ("torch", "plain"),
]


@pytest.mark.parametrize("runtime,layout", WRITERS, ids=["-".join(w) for w in WRITERS])
def test_checkpoint_without_tp_resumes_bitwise_at_dp2_tp2(tmp_path, runtime, layout):
    url = str(tmp_path / f"{runtime}-{layout}")
    reference = run_layout(layout, train_save_continue, url, runtime, layout)
    out = run_layout(READER[1], resume, url, *READER)
    assert out["meta"] == {"step": 5}
    assert mismatches(reference["saved"], out["loaded"]) == []
    assert rel_close(out["losses"], reference["losses"][5:]), (out["losses"], reference["losses"][5:])
