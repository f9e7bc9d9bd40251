"""Checkpoints saved in every other layout load into (dp=2, tp=2): bitwise model and AdamW state, and
5 more steps matching each writer's uninterrupted run.

The other direction of tests/checkpoint/geometry/test_2d_from_2d.py, with the same
runtime-named layouts: tensor-parallel writers of torch's runtime and of
shardkit's, and writers without tensor parallelism (3-rank FSDP, plain).
"""

from __future__ import annotations

import pytest

from tests.support.checkpoint_2d_helpers import mismatches, rel_close, resume, run_layout, train_save_continue

READER = ("torch", "dp2tp2")
WRITERS = [
    ("torch", "dp4tp1"),
    ("torch", "dp1tp4"),
    ("torch", "dp1tp2"),
    ("torch", "hsdp1x2tp2"),
    ("shardkit", "dp1tp2"),
    ("shardkit", "hsdp1x2tp2"),
    ("torch", "fsdp3"),         # checkpoints without tensor parallelism, into (dp 2, tp 2)
    ("shardkit", "fsdp3"),
    ("torch", "plain"),
]


@pytest.mark.parametrize("runtime,layout", WRITERS, ids=["-".join(w) for w in WRITERS])
def test_checkpoint_of_layout_resumes_bitwise_at_dp2_tp2(tmp_path, runtime, layout):
    url = str(tmp_path / f"{runtime}-{layout}")
    reference = run_layout(layout, train_save_continue, url, runtime, layout)
    out = run_layout(READER[1], resume, url, *READER)
    assert out["meta"] == {"step": 5}
    assert mismatches(reference["saved"], out["loaded"]) == []
    assert rel_close(out["losses"], reference["losses"][5:]), (out["losses"], reference["losses"][5:])
