"""The accelerator paths: streams, host-device copies for CPU offload.

Skipped without a CUDA device (``@pytest.mark.cuda``).  One rank is enough to
run every stream, event and offload copy the runtime issues on CUDA: with a
shard group of one, all-gather and reduce-scatter become local copies, but
they still run on the communication streams and are ordered by events.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.support.dist import run_on_ranks
from tests.support.runtime_common import (
    max_relative_loss_error,
    seeded_transformer,
    train_reference,
    train_sharded,
)

pytestmark = pytest.mark.cuda


def _train_on_cuda(offload: bool):
    from shardkit import CPUOffloadPolicy, OffloadPolicy, fully_shard

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    model = seeded_transformer()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    compute_devices = set()
    model.layers[0].attention.wq.register_forward_hook(
        lambda m, i, o: compute_devices.add((m.weight.device.type, o.device.type)))
    shard_devices = {p.to_local().device.type for p in model.parameters()}
    pinned = all(p.to_local().is_pinned() for p in model.parameters() if p.to_local().numel()) if offload else None
    # the loss is computed on the CPU targets; autograd carries the gradient back to the device
    losses = train_sharded(model, 5, forward=lambda m, tokens: m(tokens.cuda()).cpu())
    return {"losses": losses, "shard_devices": shard_devices, "compute": compute_devices,
            "pinned": pinned, "dtensors": all(isinstance(p, DTensor) for p in model.parameters())}


@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "cpu_offload"])
def test_training_on_cuda_matches_single_process(offload):
    ref, _ = train_reference(seeded_transformer(), 1, 5)
    (out,) = run_on_ranks(1, _train_on_cuda, offload)
    assert max_relative_loss_error(out["losses"], ref) <= 1e-5
    assert out["compute"] == {("cuda", "cuda")}
    assert out["dtensors"]
    if offload:
        assert out["shard_devices"] == {"cpu"} and out["pinned"]
    else:
        assert out["shard_devices"] == {"cuda"}
