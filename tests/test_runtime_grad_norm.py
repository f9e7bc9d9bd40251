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

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tests.dist import run_on_ranks


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
