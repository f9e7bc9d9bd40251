"""``shardkit.clip_grad_norm_``: one total norm over gradients on any meshes.

A 2-D model holds gradients on the (dp, tp) mesh (tensor-parallel blocks)
and on the dp mesh alone (embeddings, norms, head); torch's
``clip_grad_norm_`` cannot stack their norms.  Ours must give the norm one
process computes on the whole batch, clip like it, and count every piece
once: shards summed over the ranks that hold different pieces, replicas and
plain tensors once.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tests.support.dist import run_on_ranks
from tests.support.fsdp1_helpers import CollectiveCounter
from tests.support.models import TP_ARGS, lm_loss, parallelize_blocks
from tests.support.runtime_common import global_batch, local_batch, seeded_transformer
from tests.support.runtime_scenarios import per_block, shardkit_api

MAX_NORM = 0.1


def _reference(norm_type):
    model = seeded_transformer(args=TP_ARGS)
    tokens, targets = global_batch(0, 2)
    lm_loss(model(tokens), targets).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
    return norm, {name: p.grad for name, p in model.named_parameters()}


def _clip_a_2d_model(norm_type):
    import shardkit

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = per_block(parallelize_blocks(seeded_transformer(args=TP_ARGS), world["tp"]), shardkit_api(), world["dp"])
    tokens, targets = local_batch(0, 2, world["dp"].get_local_rank())
    lm_loss(model(tokens), targets).backward()
    meshes = {p.grad.device_mesh.mesh_dim_names for p in model.parameters()}
    try:
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type)
        torch_fails = False
    except RuntimeError as exc:
        torch_fails = "same mesh" in str(exc)
    with CollectiveCounter() as comm:
        norm = shardkit.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
    clipped = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return {"norm": norm, "clipped": clipped, "all_reduces": comm.counts["allreduce_"], "meshes": meshes,
            "torch_fails": torch_fails, "plain_tensor": type(norm) is torch.Tensor}


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_total_norm_over_2d_and_dp_only_gradients_equals_one_process_and_clips_like_it(norm_type):
    ref_norm, ref_grads = _reference(norm_type)
    for out in run_on_ranks(4, _clip_a_2d_model, norm_type):
        assert out["meshes"] == {("dp", "tp"), ("dp",)} and out["torch_fails"]
        assert out["plain_tensor"]
        torch.testing.assert_close(out["norm"], ref_norm, rtol=1e-6, atol=0)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(out["clipped"][name], grad, rtol=1e-5, atol=1e-8, msg=name)
        # one all-reduce over dp carries both partial sums, one over tp the 2-D one
        assert out["all_reduces"] == 2, out["all_reduces"]


def _mixed_placements():
    """Four gradients, each a differently placed piece of a known full tensor."""
    import shardkit

    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(5, 3, generator=gen) for _ in range(4)]
    grads = [distribute_tensor(full[0], mesh, [Shard(0)], src_data_rank=None),     # pieces: summed
             distribute_tensor(full[1], mesh, [Replicate()], src_data_rank=None),  # copies: once
             DTensor.from_local(full[2] / 2, mesh, [Partial()], run_check=False),  # halves of a sum
             full[3].clone()]                                                      # plain: once
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    norms = {p: shardkit.clip_grad_norm_(params, 1e9, norm_type=p) for p in (2.0, 1.0, math.inf)}
    return rank, norms, torch.stack([f.flatten() for f in full])


def test_shards_are_summed_and_replicas_partials_and_plain_tensors_counted_once():
    for rank, norms, full in run_on_ranks(2, _mixed_placements):
        for norm_type, norm in norms.items():
            torch.testing.assert_close(norm, torch.linalg.vector_norm(full, norm_type), rtol=1e-6, atol=0)
