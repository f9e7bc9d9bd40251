"""Shared reads with GPU targets: the transfer buffer's device side and GPU targets on the gloo wire.

Skipped without a CUDA device (``@pytest.mark.cuda``).  NCCL itself needs a
GPU per rank (``benchmarks/shared_reads_nccl.py`` runs it where there are
two); what one GPU can check is that the buffer carries host and device
tensors through device memory bitwise, and that GPU targets shared between
gloo ranks arrive bitwise through one round's staging.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.cuda


def test_the_transfer_buffer_carries_host_and_gpu_tensors_through_device_memory_bitwise():
    from shardkit.checkpoint.io.transfer_buffer import TransferBuffer

    buffer = TransferBuffer(4096, torch.device("cuda"))
    assert buffer.host.is_pinned() and buffer.wire.device.type == "cuda"
    host_source = torch.randn(10, 7).t()  # strided host memory: through the pinned twin
    gpu_source = torch.arange(33, dtype=torch.int16, device="cuda")  # device to device
    sent = buffer.put(0, host_source)
    assert (sent.device.type, sent.dtype, sent.numel()) == ("cuda", torch.uint8, 280)
    buffer.put(320, gpu_source)  # the next 64-byte slot after 280 bytes
    host_target = torch.zeros(7, 10)
    gpu_target = torch.zeros(11, 3, dtype=torch.int16, device="cuda").t()
    buffer.take(0, host_target)
    buffer.take(320, gpu_target)
    assert torch.equal(host_target, host_source)
    assert torch.equal(gpu_target, gpu_source.view(3, 11))


def _share_a_gpu_target(wire: str | None) -> tuple[bool, int]:
    from shardkit.checkpoint.formats.base import ReadRequest
    from shardkit.checkpoint.io.dist import Dist
    from shardkit.checkpoint.training.shared_reads import exchange, share_reads

    truth = torch.arange(3000, dtype=torch.float32).reshape(60, 50)
    out = torch.zeros(50, 60, device="cuda").t()  # a strided GPU target on both ranks
    plan = share_reads([ReadRequest("w", 0, ((0, 0), (60, 50)), out)], Dist(), round_bytes=4096)
    for request in plan.mine:
        request.out.copy_(truth)
    held = exchange(plan, Dist(), wire=None if wire is None else torch.device(wire))
    return torch.equal(out.cpu(), truth), held


@pytest.mark.parametrize("wire", [None, "cpu"], ids=["gloo", "staged"])
def test_a_gpu_target_shared_by_two_gloo_ranks_arrives_bitwise_through_one_round_of_staging(wire):
    results = run_on_ranks(2, _share_a_gpu_target, wire)
    assert [same for same, _ in results] == [True, True]
    assert all(0 < held <= 4096 for _, held in results)
