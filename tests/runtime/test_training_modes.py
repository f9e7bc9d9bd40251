"""Every training mode of ``fully_shard`` keeps data-parallel parity.

Each scenario (see ``tests/support/runtime_scenarios.py``) trains 4 AdamW steps with
``clip_grad_norm_``.  Its per-step losses must match one process on the
global batch to a relative 1e-6 (fp32), and every shard must be bitwise
equal to torch's own ``fully_shard`` run on the same mesh and micro-batches,
on the same mesh with the same placements.

The ``tp_*`` scenarios are the 2-D recipe on 4 ranks: tensor parallelism in
every block (q/k/v column-wise, output row-wise, MLP column-/row-wise; the
sequence-parallel one adds ``SequenceParallel`` norms and
``PrepareModuleInput``/``Output``), FSDP over dp (2, 2) or HSDP over
(dp_replicate, dp_shard) (1, 2, 2); both sides clip with
``shardkit.clip_grad_norm_``, since torch's fails on mixed meshes.
"""

from __future__ import annotations

import functools

import pytest

from tests.support.dist import run_on_ranks
from tests.support.runtime_common import max_relative_loss_error
from tests.support.runtime_scenarios import SCENARIOS, reference_losses, run_scenario

LOSS_RTOL = 1e-6
FP32_SCENARIOS = [name for name in SCENARIOS if name != "bf16_mixed_precision"]


@functools.lru_cache(maxsize=None)
def _reference(name: str) -> list[float]:
    return reference_losses(name)


def _check(name: str) -> list[dict]:
    results = run_on_ranks(SCENARIOS[name].world, run_scenario, name)
    for out in results:
        assert out["losses"] == out["torch_losses"], (out["rank"], out["losses"], out["torch_losses"])
        assert all(out["bitwise_equal_to_torch"].values()), out["bitwise_equal_to_torch"]
        assert all(out["layout_equal_to_torch"].values()), out["layout_equal_to_torch"]  # mesh, placements, shape
    return results


@pytest.mark.parametrize("name", FP32_SCENARIOS)
def test_training_mode_matches_single_process_and_torch(name):
    results = _check(name)
    ref = _reference(name)
    for out in results:
        assert max_relative_loss_error(out["losses"], ref) <= LOSS_RTOL, (out["rank"], out["losses"], ref)
    if name == "frozen_params":
        frozen = [k for k, v in results[0]["requires_grad"].items() if not v]
        assert "tok_embeddings.weight" in frozen and "layers.0.attention.wq.weight" in frozen


# Measured (the run is deterministic): bf16 compute with fp32 reduction
# against the fp32 single-process run differs per step by 2.6e-5 .. 1.1e-3
# in relative loss over the 4 steps (max 1.1e-3, step 1).  The bound leaves
# headroom without hiding a real bug (a wrong reduction moves losses by 1e-1).
BF16_VS_FP32_BOUND = 5e-3


def test_bf16_mixed_precision_stays_close_to_fp32_and_equals_torch():
    results = _check("bf16_mixed_precision")
    ref = _reference("bf16_mixed_precision")  # the fp32 single-process run
    error = max_relative_loss_error(results[0]["losses"], ref)
    assert 0 < error <= BF16_VS_FP32_BOUND, error
