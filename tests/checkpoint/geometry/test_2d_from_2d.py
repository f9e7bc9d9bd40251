"""A checkpoint saved at (dp=2, tp=2) loads into every other layout: bitwise model and AdamW state, and
5 more steps matching the uninterrupted run.

The writer and the readers are named by runtime (tests/support/checkpoint_2d_helpers.py):
``torch`` is torch's ``fully_shard`` + ``parallelize_module`` (Colwise/Rowwise
plan, dims 37, 51 and 26 that do not divide the world), ``shardkit`` is
shardkit's own ``fully_shard`` where it has the layout.  shardkit's 2-D runtime
joins with one line in ``WRITERS`` and one per layout in ``READERS``.
"""

from __future__ import annotations

import pytest

from tests.support.checkpoint_2d_helpers import mismatches, rel_close, resume, run_layout, train_save_continue

WRITERS = [("torch", "dp2tp2")]
READERS = [
    ("torch", "dp4tp1"),
    ("torch", "dp1tp4"),
    ("torch", "dp1tp2"),
    ("torch", "fsdp3"),
    ("shardkit", "fsdp3"),
    ("shardkit", "dp1tp4"),
    ("shardkit", "hsdp1x2tp2"),
    ("torch", "hsdp1x2tp2"),
    ("torch", "plain"),
]


@pytest.fixture(scope="module", params=WRITERS, ids=["-".join(w) for w in WRITERS])
def saved_2d(request, tmp_path_factory):
    runtime, layout = request.param
    url = str(tmp_path_factory.mktemp("from2d") / f"{runtime}-{layout}")
    return url, run_layout(layout, train_save_continue, url, runtime, layout)


@pytest.mark.parametrize("runtime,layout", READERS, ids=["-".join(r) for r in READERS])
def test_two_d_checkpoint_resumes_bitwise_in_layout(saved_2d, runtime, layout):
    url, reference = saved_2d
    out = run_layout(layout, resume, url, runtime, layout)
    assert out["meta"] == {"step": 5}
    keys = reference["saved"]["tensors"].keys()
    assert any(k.endswith(".exp_avg_sq") for k in keys) and any(k.endswith(".step") for k in keys)
    assert mismatches(reference["saved"], out["loaded"]) == []
    assert rel_close(out["losses"], reference["losses"][5:]), (out["losses"], reference["losses"][5:])
