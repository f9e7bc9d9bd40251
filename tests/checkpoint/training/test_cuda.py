"""Checkpoints of GPU-resident state: staging through page-locked memory on a side stream, loads into the GPU.

Skipped without a CUDA device (``@pytest.mark.cuda``).  What must hold there:
``async_save`` returns before its device-to-host copies finish, yet what it
writes is the state *at the call* -- kernels the training stream queues
afterwards wait for the copy -- with a page-locked staging buffer reused from
save to save; and ``load`` fills GPU targets (plain and DTensor) bitwise.
"""

from __future__ import annotations

import pytest
import torch

import shardkit.checkpoint as skc
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_async_save_writes_the_state_at_the_call_though_training_changes_it_right_after(tmp_path, writer):
    from shardkit.checkpoint.training.async_save.saver import background_saver

    state = {"w": torch.arange(4 << 20, dtype=torch.float32, device="cuda").reshape(1024, -1),
             "b": torch.full((333,), 2.0, dtype=torch.bfloat16, device="cuda")}
    for i in range(3):
        before = {k: v.clone() for k, v in state.items()}
        future = skc.async_save(state, str(tmp_path / f"s{i}"), writer=writer)
        for v in state.values():  # queued at once on the training stream: must not reach the staged copy
            v.mul_(3).add_(1)
        future.result()
        out = {k: torch.empty_like(v, device="cpu") for k, v in state.items()}
        skc.load(out, str(tmp_path / f"s{i}"))
        for k in state:
            assert torch.equal(out[k], before[k].cpu()), (i, k)
    pool = background_saver().pools[writer]
    assert pool.buffer is not None and pool.buffer.pinned


def test_load_fills_gpu_targets_bitwise_and_casts_on_request(tmp_path):
    truth = {"w": torch.randn(257, 129), "v": torch.randn(7).to(torch.bfloat16)}
    skc.save(truth, str(tmp_path / "ck"))
    targets = {k: torch.zeros_like(v, device="cuda") for k, v in truth.items()}
    skc.load(targets, str(tmp_path / "ck"))
    assert all(targets[k].is_cuda and torch.equal(targets[k].cpu(), truth[k]) for k in truth)
    half = {"w": torch.zeros(257, 129, dtype=torch.bfloat16, device="cuda"), "v": targets["v"]}
    skc.load(half, str(tmp_path / "ck"), dtype_cast=True)
    assert torch.equal(half["w"].cpu(), truth["w"].to(torch.bfloat16))


def _dtensor_round_trip(url: str) -> bool:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    truth = torch.randn(64, 48, generator=torch.Generator().manual_seed(5))
    state = {"w": distribute_tensor(truth.cuda(), mesh, [Shard(0)]), "step": 3}
    skc.async_save(state, url).result()
    state["w"].to_local().zero_()
    again = {"w": distribute_tensor(torch.zeros(64, 48, device="cuda"), mesh, [Shard(0)]), "step": 0}
    skc.load(again, url)
    return torch.equal(again["w"].to_local().cpu(), truth) and again["step"] == 3  # one rank holds it all


def test_a_gpu_dtensor_round_trips_through_async_save_and_load(tmp_path):
    assert run_on_ranks(1, _dtensor_round_trip, str(tmp_path / "dt")) == [True]
