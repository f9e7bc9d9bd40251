"""``replicate()`` against torch's own (``torch.distributed._composable.replicate_with_fsdp``).

The same seeded model is replicated by torch and by shardkit, alone and
composed with tensor parallelism on a (dp, tp) mesh, and trained on the same
inputs: every parameter's placements, every gradient and every parameter after
each step are equal, bitwise (each all-reduce sums two values).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from tests.support.dist import run_on_ranks

IN, HIDDEN, OUT, BATCH = 8, 12, 6, 4


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def _replicate_of(impl: str):
    if impl == "torch":
        from torch.distributed._composable.replicate_with_fsdp import replicate
    else:
        from shardkit import replicate
    return replicate


def _train(model: nn.Module, dp_rank: int, steps: int = 3) -> list[dict]:
    """Per step: every parameter's local gradient and local value after the step;
    the batch differs per data-parallel rank and is the same across tp ranks."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    history = []
    for step in range(steps):
        torch.manual_seed(100 * step + dp_rank)
        out = model(torch.randn(BATCH, IN))
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        (out * out).mean().backward()
        history.append({"grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()}})
        opt.step()
        opt.zero_grad()
        history[-1]["params"] = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    return history


def _layout(model: nn.Module) -> dict:
    return {name: (p.device_mesh.mesh_dim_names, p.device_mesh.mesh.tolist(), tuple(p.placements))
            for name, p in model.named_parameters()}


def _differences(a: list[dict], b: list[dict]) -> list[str]:
    return [f"step {step} {kind} {name}" for step, (x, y) in enumerate(zip(a, b)) for kind in ("grads", "params")
            for name in x[kind] if not torch.equal(x[kind][name], y[kind][name])]


def _replicated_runs() -> dict:
    runs = {}
    for impl in ("torch", "shardkit"):
        replicate = _replicate_of(impl)
        model = _mlp(0)
        replicate(model[0])
        replicate(model)
        from shardkit import FSDPModule

        kind = (type(model).__name__, isinstance(model, FSDPModule), isinstance(model, nn.Sequential))
        runs[impl] = (_layout(model), kind, _train(model, dist.get_rank()))
    return runs


def test_replicate_averages_gradients_over_every_rank_as_torchs_replicate():
    for rank, runs in enumerate(run_on_ranks(2, _replicated_runs)):
        (torch_layout, torch_class, torch_history), (ours_layout, ours_class, ours_history) = runs.values()
        assert ours_layout == torch_layout, rank
        assert ours_layout["0.weight"] == (("replicate",), [0, 1], (Replicate(),))
        assert torch_class == ("ReplicateSequential", False, True)  # torch's own FSDPModule, not shardkit's
        assert ours_class == ("ReplicateSequential", True, True)
        assert _differences(torch_history, ours_history) == [], rank


def _tensor_parallel_runs() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    runs = {}
    for impl in ("torch", "shardkit"):
        model = parallelize_module(_mlp(0), world["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        _replicate_of(impl)(model, mesh=world["dp"])
        runs[impl] = (_layout(model), _train(model, world.get_local_rank("dp")))
    return runs


def test_replicate_composes_with_tensor_parallelism_as_torchs_replicate():
    for rank, runs in enumerate(run_on_ranks(4, _tensor_parallel_runs)):
        (torch_layout, torch_history), (ours_layout, ours_history) = runs["torch"], runs["shardkit"]
        assert ours_layout == torch_layout, rank
        assert ours_layout["0.weight"] == (("dp", "tp"), [[0, 1], [2, 3]], (Replicate(), Shard(0)))
        assert ours_layout["2.weight"][2] == (Replicate(), Shard(1))
        assert _differences(torch_history, ours_history) == [], rank


def _misuse(impl: str) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardkit import fully_shard

    replicate = _replicate_of(impl)
    shard = torch_fully_shard if impl == "torch" else fully_shard
    errors = {}
    for name, call in [("after fully_shard", lambda: replicate(shard(nn.Linear(2, 2)))),
                       ("2-D mesh", lambda: replicate(nn.Linear(2, 2), mesh=init_device_mesh(
                           "cpu", (2, 1), mesh_dim_names=("a", "b"))))]:
        with pytest.raises(Exception) as caught:
            call()
        errors[name] = (caught.type.__mro__, str(caught.value))
    return errors


def test_replicate_refuses_what_torchs_replicate_refuses_with_the_same_builtin_and_wording():
    theirs, ours = run_on_ranks(2, _misuse, "torch")[0], run_on_ranks(2, _misuse, "shardkit")[0]
    assert RuntimeError in theirs["after fully_shard"][0] and RuntimeError in ours["after fully_shard"][0]
    assert ours["after fully_shard"][1].startswith(theirs["after fully_shard"][1])
    assert ValueError in theirs["2-D mesh"][0] and ValueError in ours["2-D mesh"][0]
    assert ours["2-D mesh"][1].startswith("replicate expects a 1D DeviceMesh but got")
