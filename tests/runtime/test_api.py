"""The ``FSDPModule`` surface and the state-dict contract.

What a user (and the checkpoint subsystem, which sees only DTensors) relies
on: the class union, unchanged FQNs, ``forward`` only through hooks or after
``unshard()``, state dicts of DTensors that load in place and keep the
padding right, ``.to(dtype)``, ignored parameters, grouped modules, and the
gradient knobs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.support.dist import run_on_ranks
from tests.support.models import ModelArgs, Transformer, lm_loss
from tests.support.runtime_common import (
    global_batch,
    local_batch,
    max_relative_loss_error,
    seeded_transformer,
    shard_blocks_and_root,
    train_reference,
    train_sharded,
)


def _padding_intact(model) -> bool:
    """Every shard is a view into its padded buffer, and the padding is zero."""
    from shardkit.runtime import sharded_params_of

    for p in sharded_params_of(model):
        local = p.sharded_param._local_tensor
        if local.untyped_storage().data_ptr() != p.padded.untyped_storage().data_ptr():
            return False
        if p.padded.dtype != local.dtype:
            return False
        padded = p.padded.view(p.padded_size)
        if padded.narrow(p.shard_dim, p.real_rows, padded.shape[p.shard_dim] - p.real_rows).abs().sum() != 0:
            return False
    return True


def _module_surface():
    from shardkit import FSDPModule, register_fsdp_forward_method

    model = shard_blocks_and_root(seeded_transformer())
    tokens, _ = local_batch(0, dist.get_world_size(), dist.get_rank())
    out = {
        "class": type(model).__name__, "block_class": type(model.layers[0]).__name__,
        "is_transformer": isinstance(model, Transformer), "is_fsdp": isinstance(model, FSDPModule),
        "keys": list(model.state_dict()),
        "values_are_dtensors": all(isinstance(v, DTensor) for v in model.state_dict().values()),
    }
    try:
        model.forward(tokens)  # no hooks: the root's parameters are still sharded DTensors
        out["bare_forward"] = "ran"
    except Exception as exc:  # noqa: BLE001
        out["bare_forward"] = type(exc).__name__
    expected = model(tokens).detach()
    handle = model.unshard(async_op=True)
    handle.wait()
    out["after_unshard_plain"] = not isinstance(model.output.weight, DTensor)
    for layer in model.layers:
        layer.unshard()
    out["forward_after_unshard_equal"] = torch.equal(model.forward(tokens).detach(), expected)
    for layer in [*model.layers, model]:
        layer.reshard()
    out["after_reshard_dtensor"] = isinstance(model.output.weight, DTensor)
    register_fsdp_forward_method(model, "forward")
    out["registered_forward_equal"] = torch.equal(model.forward(tokens).detach(), expected)
    register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # a no-op on unsharded modules
    from shardkit import fully_shard

    sliced = fully_shard(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))[0:1]  # containers build new instances
    out["slice_class"] = type(sliced).__name__
    return out


def test_sharded_module_keeps_its_class_keys_and_runs_forward_only_through_hooks():
    ref_keys = list(seeded_transformer().state_dict())
    for out in run_on_ranks(2, _module_surface):
        assert out["class"] == "FSDPTransformer" and out["block_class"] == "FSDPBlock"
        assert out["is_transformer"] and out["is_fsdp"]
        assert out["keys"] == ref_keys and out["values_are_dtensors"]
        assert out["bare_forward"] != "ran"
        assert out["after_unshard_plain"] and out["forward_after_unshard_equal"]
        assert out["after_reshard_dtensor"] and out["registered_forward_equal"]
        assert out["slice_class"] == "Sequential"  # a slice of a sharded container is a plain one


def _load_and_cast():
    model = shard_blocks_and_root(seeded_transformer())
    torch.manual_seed(123)  # the same "checkpoint" on every rank
    full = {k: torch.randn_like(v) for k, v in seeded_transformer().state_dict().items()}
    current = model.state_dict()
    sharded = {k: distribute_tensor(v, current[k].device_mesh, current[k].placements) for k, v in full.items()}
    ptrs = [p.data_ptr() for p in model.parameters()]
    model.load_state_dict(sharded)
    out = {"in_place": ptrs == [p.data_ptr() for p in model.parameters()],
           "loaded": all(torch.equal(model.state_dict()[k].full_tensor(), v) for k, v in full.items()),
           "padding_after_load": _padding_intact(model)}
    model.load_state_dict({k: nn.Parameter(v) for k, v in sharded.items()}, assign=True)
    out["padding_after_assign"] = _padding_intact(model)
    out["loaded_after_assign"] = all(torch.equal(model.state_dict()[k].full_tensor(), v) for k, v in full.items())
    model.to(torch.float64)
    out["dtype_after_to"] = {str(p.dtype) for p in model.parameters()}
    out["padding_after_to"] = _padding_intact(model)
    tokens, targets = local_batch(0, dist.get_world_size(), dist.get_rank())
    loss = lm_loss(model(tokens), targets)
    loss.backward()
    dist.all_reduce(loss := loss.detach().clone())
    out["loss64"] = (loss / dist.get_world_size()).item()
    out["grad_dtypes"] = {str(p.grad.dtype) for p in model.parameters()}
    return out, full


def test_load_state_dict_and_to_dtype_after_sharding_keep_the_padding_right():
    results = run_on_ranks(3, _load_and_cast)
    full = results[0][1]
    reference = seeded_transformer()
    reference.load_state_dict(full)
    reference.to(torch.float64)
    tokens, targets = global_batch(0, 3)
    expected = lm_loss(reference(tokens), targets).item()
    for out, _ in results:
        assert out["in_place"] and out["loaded"] and out["padding_after_load"]
        assert out["padding_after_assign"] and out["loaded_after_assign"]
        assert out["dtype_after_to"] == {"torch.float64"} and out["padding_after_to"]
        assert out["grad_dtypes"] == {"torch.float64"}
        assert abs(out["loss64"] - expected) / expected < 1e-12


def _dim1_where_even(p):
    return Shard(1) if p.dim() == 2 and p.shape[1] % dist.get_world_size() == 0 else None


def _ignored_and_dim1():
    from shardkit import fully_shard

    model = seeded_transformer()
    ignored = model.norm.weight
    for layer in model.layers:
        fully_shard(layer, shard_placement_fn=_dim1_where_even)
    fully_shard(model, ignored_params={ignored})
    tokens, targets = local_batch(0, dist.get_world_size(), dist.get_rank())
    lm_loss(model(tokens), targets).backward()
    local_grad = ignored.grad.clone()
    summed = local_grad.clone()
    dist.all_reduce(summed)
    placements = {k: (tuple(p.shape), p.placements[0].dim) for k, p in model.layers[0].named_parameters()}
    model.zero_grad()
    trained = shard_blocks_and_root(seeded_transformer(), shard_placement_fn=_dim1_where_even)
    return {
        "ignored_is_plain": not isinstance(model.norm.weight, DTensor),
        "ignored_grad_is_local": not torch.equal(local_grad * dist.get_world_size(), summed),
        "placements": placements,
        "dim1_losses": train_sharded(trained, 5),
    }


def test_ignored_params_stay_local_and_dim1_placement_trains_like_dim0():
    ref, _ = train_reference(seeded_transformer(), 2, 5)
    for out in run_on_ranks(2, _ignored_and_dim1):
        assert out["ignored_is_plain"] and out["ignored_grad_is_local"]
        dims = {shape: dim for shape, dim in out["placements"].values()}
        assert dims[(26, 26)] == 1 and dims[(51, 26)] == 1  # 26 columns divide 2 ranks
        assert dims[(26, 51)] == 0  # 51 columns do not: stays on dim 0
        assert max_relative_loss_error(out["dim1_losses"], ref) <= 1e-6


TIED = ModelArgs(tie_embeddings=True)


def _train_tied_group():
    from shardkit import fully_shard

    model = seeded_transformer(args=TIED)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard([model.tok_embeddings, model.output])  # one group for the tied weight
    fully_shard(model)
    return train_sharded(model, 5)


def test_list_of_modules_forms_one_group_for_tied_embeddings():
    ref, _ = train_reference(seeded_transformer(args=TIED), 2, 5)
    for losses in run_on_ranks(2, _train_tied_group):
        assert max_relative_loss_error(losses, ref) <= 1e-6


class _TwoPaths(nn.Module):
    """Each rank takes one branch: the other branch's params get no gradient there."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x, use_a: bool):
        return self.head(self.a(x) if use_a else self.b(x))


def _gradient_knobs():
    from shardkit import fully_shard

    rank = dist.get_rank()
    x = torch.full((2, 4), float(rank + 1))
    results = {}
    for name in ("default", "divide_by_1", "unused_per_rank"):
        model = fully_shard(_TwoPaths())
        if name == "divide_by_1":
            model.set_gradient_divide_factor(1.0)
        if name == "unused_per_rank":
            model.set_reduce_scatter_unused_params(True)
        model(x, use_a=name != "unused_per_rank" or rank == 0).sum().backward()
        results[name] = {k: p.grad.full_tensor() for k, p in model.named_parameters() if p.grad is not None}
    return results


def _two_paths_grads(use_a_per_rank):
    grads = {}
    for rank, use_a in enumerate(use_a_per_rank):
        model = _TwoPaths()
        model(torch.full((2, 4), float(rank + 1)), use_a).sum().backward()
        for k, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[k] = grads.get(k, 0) + g / len(use_a_per_rank)
    return grads


def test_gradient_divide_factor_and_unused_params_reduce_as_documented():
    results = run_on_ranks(2, _gradient_knobs)[0]
    assert set(results["default"]) == {"a.weight", "a.bias", "head.weight", "head.bias"}  # b unused everywhere
    for key, grad in results["default"].items():
        assert torch.allclose(results["divide_by_1"][key], 2 * grad, rtol=0, atol=1e-6)  # a SUM instead of a mean
    # rank 0 used branch a, rank 1 branch b: every param is reduced, zeros standing in for the unused side
    expected = _two_paths_grads([True, False])
    assert set(results["unused_per_rank"]) == set(expected)
    for key, grad in expected.items():
        assert torch.allclose(results["unused_per_rank"][key], grad, rtol=0, atol=1e-6), key


def _recover_and_non_root():
    model = shard_blocks_and_root(seeded_transformer())
    tokens, targets = local_batch(0, dist.get_world_size(), dist.get_rank())
    try:
        model(tokens[:, :1000].float())  # an embedding on float ids raises mid-forward
    except RuntimeError:
        model.reset_iter_state()
    losses = train_sharded(model, 3)
    # a block run on its own after root steps: forward/backward through it alone
    h = torch.randn(2, 4, 26, requires_grad=True)
    model.layers[1](h).sum().backward()
    grads = {k: p.grad is not None for k, p in model.layers[1].named_parameters()}
    return losses, grads, isinstance(model.layers[1].attention.wq.weight, DTensor)


def test_reset_iter_state_recovers_and_a_block_can_run_on_its_own():
    ref, _ = train_reference(seeded_transformer(), 2, 3)
    for losses, grads, resharded in run_on_ranks(2, _recover_and_non_root):
        assert max_relative_loss_error(losses, ref) <= 1e-6
        assert all(grads.values()) and resharded


def _mixed_precision_dtypes():
    from shardkit import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    seen = {}
    model[0].register_forward_pre_hook(lambda m, args: seen.update(input=args[0].dtype))
    model[0].register_forward_hook(lambda m, args, out: seen.update(weight=m.weight.dtype))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                      output_dtype=torch.float64))
    reduced_in = []

    class Recording:  # the default reduce-scatter, recording the dtype it is given
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            reduced_in.append(input_tensor.dtype)
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    model.set_custom_reduce_scatter(Recording())
    out = model(torch.randn(4, 6))
    out.sum().backward()
    return {"input": seen["input"], "weight": seen["weight"], "output": out.dtype, "reduced_in": reduced_in,
            "shard_dtype": {p.dtype for p in model.parameters()},
            "grad_dtype": {p.grad.dtype for p in model.parameters()}}


def test_mixed_precision_casts_inputs_params_outputs_and_reduces_in_the_reduce_dtype():
    for out in run_on_ranks(2, _mixed_precision_dtypes):
        assert out["input"] == torch.bfloat16 and out["weight"] == torch.bfloat16
        assert out["output"] == torch.float64
        assert out["reduced_in"] == [torch.float32]  # one reduce-scatter, in fp32
        assert out["shard_dtype"] == {torch.float32} and out["grad_dtype"] == {torch.float32}
