"""Training scenarios run three ways: shardkit, torch's own ``fully_shard``
(same mesh, same micro-batches) and one process on the global batch.

A scenario says how to build the model, how to shard it (written once
against an ``api`` namespace so the same code drives shardkit and torch),
and how to train it.  ``run_scenario`` runs on the ranks; the test process
computes the single-process reference with the same semantics.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor
from torch.utils.checkpoint import checkpoint

from tests.support.models import TP_ARGS, Transformer, parallelize_blocks
from tests.support.runtime_common import ARGS, seeded_transformer, train_reference, train_sharded

# Enough for every mode to show after its first step: the second forward follows the order the first
# recorded (prefetch), gradients kept as zeros are added to (set_to_none every other step), and
# AdamW's moments carry over; more steps repeat those same paths.
STEPS = 4


def shardkit_api():
    import shardkit

    return types.SimpleNamespace(name="shardkit", fully_shard=shardkit.fully_shard,
                                 MixedPrecisionPolicy=shardkit.MixedPrecisionPolicy,
                                 CPUOffloadPolicy=shardkit.CPUOffloadPolicy, pin_memory=True)


def torch_api():
    from torch.distributed import fsdp

    # torch pins offloaded shards unconditionally, which needs an accelerator
    return types.SimpleNamespace(name="torch", fully_shard=fsdp.fully_shard,
                                 MixedPrecisionPolicy=fsdp.MixedPrecisionPolicy,
                                 CPUOffloadPolicy=fsdp.CPUOffloadPolicy, pin_memory=False)


# ----------------------------------------------------------------- model variants


class TwiceTransformer(Transformer):
    """Runs ``layers[0]`` twice per forward: one group, two uses."""

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        h = self.layers[0](h)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class CheckpointOutsideTransformer(Transformer):
    """Activation checkpointing *around* each sharded block: the recompute
    re-enters the block's forward hooks during backward."""

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False)
        return self.output(self.norm(h))


class CheckpointedBlock(nn.Module):
    """Activation checkpointing *inside* the sharded unit (torchtitan's layout)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def with_checkpoint_inside(model: nn.Module) -> nn.Module:
    for i, layer in enumerate(model.layers):
        model.layers[i] = CheckpointedBlock(layer)
    return model


def with_unused_param(model: nn.Module) -> nn.Module:
    torch.manual_seed(7)
    model.layers[1].unused = nn.Linear(ARGS.dim, 5)  # never called in forward
    return model


class _FrozenScale(nn.Module):
    """A frozen bf16 parameter in an fp32 group: the group all-gathers bytes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim).to(torch.bfloat16), requires_grad=False)

    def forward(self, x):
        return x * self.scale.float()


def with_mixed_dtype_groups(model: nn.Module) -> nn.Module:
    for layer in model.layers:
        layer.feed_forward = nn.Sequential(layer.feed_forward, _FrozenScale(ARGS.dim))
    return model


def with_frozen_params(model: nn.Module) -> nn.Module:
    model.tok_embeddings.weight.requires_grad_(False)
    for layer in model.layers:
        layer.attention_norm.weight.requires_grad_(False)  # frozen and trainable in one group
        layer.attention.wq.weight.requires_grad_(False)
    return model


# ------------------------------------------------------------------- scenarios


def per_block(model, api, mesh, **kwargs):
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh, **kwargs)
    api.fully_shard(model, mesh=mesh, **kwargs)
    return model


def _reshard(value, root_value=None):
    def shard(model, api, mesh):
        for layer in model.layers:
            api.fully_shard(layer, mesh=mesh, reshard_after_forward=value)
        api.fully_shard(model, mesh=mesh, reshard_after_forward=root_value)
        return model
    return shard


def _mixed_precision(model, api, mesh):
    policy = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return per_block(model, api, mesh, mp_policy=policy)


def _offload(model, api, mesh):
    return per_block(model, api, mesh, offload_policy=api.CPUOffloadPolicy(pin_memory=api.pin_memory))


def _explicit_prefetch(model, api, mesh):
    per_block(model, api, mesh)
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 3])
        layer.set_modules_to_backward_prefetch(list(reversed(layers[max(0, i - 2):i])))
    return model


def _unshard_then_forward(model, tokens):
    model.unshard()  # issue the root's all-gather before forward (tutorial pattern)
    return model(tokens)


def _no_grad_forward_first(model, tokens):
    with torch.no_grad():  # e.g. an evaluation pass: no backward follows, nothing may be left behind
        model(tokens)
    return model(tokens)


def _async_unshard(model, api, mesh):
    per_block(model, api, mesh)
    if api.name == "shardkit":
        from shardkit.runtime import param_groups_of

        for module in [*model.layers, model]:
            for group in param_groups_of(module):
                group.unshard_async_op = True
    else:
        for module in [*model.layers, model]:
            module._set_unshard_async_op(True)
    return model


def _async_handle_forward(model, tokens):
    handle = model.layers[0].unshard(async_op=True)
    out = model(tokens)
    if handle is not None:
        handle.wait()  # already completed by the block's pre-forward: a no-op
    return out


def _meta_init(model_cls=Transformer):
    def build():
        with torch.device("meta"):
            return model_cls(ARGS)
    return build


def _load_seeded_weights(model):
    """Overwrite a sharded model with the seeded reference weights, cut to its layout."""
    full = seeded_transformer().state_dict()
    sharded = model.state_dict()
    model.load_state_dict({k: distribute_tensor(v, sharded[k].device_mesh, sharded[k].placements)
                           for k, v in full.items()})
    return model


def _materialize_and_load(model, api, mesh):
    """fully_shard on meta, to_empty, reset_parameters, then load the seeded
    weights as DTensors (the tutorial's flow)."""
    per_block(model, api, mesh)
    model.to_empty(device="cpu")
    model.reset_parameters()
    return _load_seeded_weights(model)


def _materialize_unit_by_unit(model, api, mesh):
    """Materialize each block right before sharding it (FSDP1's param_init_fn
    flow): the materialized originals die once their block is sharded, and
    CPython hands their ids to the next block's new parameters."""
    for unit in [*model.layers, model]:
        for sub in unit.modules():
            if any(p.is_meta for p in sub.parameters(recurse=False)):
                sub.to_empty(device="cpu", recurse=False)
                sub.reset_parameters()
        api.fully_shard(unit, mesh=mesh)
    return _load_seeded_weights(model)


def _keep_params_between_micro_batches(model, step, micro):
    model.set_reshard_after_backward(micro == 1)  # the second micro-batch's forward needs no all-gather


def _last_backward_of_two(model, step, micro):
    model.set_is_last_backward(micro == 1)


def _embedding_group_without_backward_unshard(model, api, mesh):
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh)
    api.fully_shard(model.tok_embeddings, mesh=mesh)
    model.tok_embeddings.set_unshard_in_backward(False)  # embedding backward never reads the weight
    api.fully_shard(model, mesh=mesh)
    return model


def _tensor_parallel(sequence_parallel: bool = False):
    """TP inside each block over the mesh's "tp" dim, then FSDP (per block and the
    root) over its data-parallel dims: the 2-D recipe."""
    def shard(model, api, mesh):
        parallelize_blocks(model, mesh["tp"], sequence_parallel)
        return per_block(model, api, mesh[data_parallel_dims(mesh)])
    return shard


def shardkit_clip(parameters, max_norm):
    # torch's clip_grad_norm_ cannot mix 2-D (TP'd) and 1-D (plain) gradients; both sides use ours
    import shardkit

    return shardkit.clip_grad_norm_(parameters, max_norm)


def _hsdp_reduce_scatter_only(model, step, micro):
    model.set_requires_gradient_sync(True)
    model.set_requires_all_reduce(micro == 1)  # first micro-batch: reduce-scatter only


@dataclass
class Scenario:
    shape: tuple[int, ...] = (2,)
    build: Callable[[], nn.Module] = seeded_transformer
    shard: Callable = per_block
    micro_steps: int = 1
    set_to_none: Callable[[int], bool] = lambda step: True
    forward: Callable | None = None
    before_backward: Callable | None = None
    sync_each_micro_step: bool = False
    reference_build: Callable[[], nn.Module] | None = None
    mesh_names: tuple[str, ...] | None = None  # None: all dims data-parallel; else the "dp*" ones are
    clip: Callable | None = None
    extra: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def data_parallel_world(self) -> int:
        """How many ranks hold different batch slices (the reference's world)."""
        if self.mesh_names is None:
            return self.world
        n = 1
        for size, name in zip(self.shape, self.mesh_names):
            n *= size if name.startswith("dp") else 1
        return n


def _tp_scenario(shape: tuple[int, ...], sequence_parallel: bool = False) -> Scenario:
    names = ("dp", "tp") if len(shape) == 2 else ("dp_replicate", "dp_shard", "tp")
    return Scenario(shape=shape, mesh_names=names, build=lambda: seeded_transformer(args=TP_ARGS),
                    shard=_tensor_parallel(sequence_parallel), clip=shardkit_clip)


SCENARIOS: dict[str, Scenario] = {
    "reshard_after_forward_true_everywhere": Scenario(shard=_reshard(True, True)),
    "reshard_after_forward_false": Scenario(shard=_reshard(False, False)),
    "reshard_after_forward_2": Scenario(shape=(4,), shard=_reshard(2)),
    "gradient_accumulation_without_sync": Scenario(micro_steps=2),
    "reshard_after_backward_false_between_micro_batches": Scenario(
        micro_steps=2, before_backward=_keep_params_between_micro_batches),
    "two_backwards_per_step_with_is_last_backward": Scenario(
        micro_steps=2, sync_each_micro_step=True, before_backward=_last_backward_of_two),
    "embedding_group_without_backward_unshard": Scenario(shard=_embedding_group_without_backward_unshard),
    "zero_grad_set_to_none_false": Scenario(set_to_none=lambda step: step % 2 == 0),
    "module_called_twice": Scenario(build=lambda: seeded_transformer(cls=TwiceTransformer)),
    "unused_parameter": Scenario(build=lambda: with_unused_param(seeded_transformer())),
    "frozen_params": Scenario(build=lambda: with_frozen_params(seeded_transformer())),
    "frozen_bf16_param_in_fp32_group": Scenario(build=lambda: with_mixed_dtype_groups(seeded_transformer())),
    "checkpoint_around_sharded_blocks": Scenario(build=lambda: seeded_transformer(cls=CheckpointOutsideTransformer)),
    "checkpoint_inside_sharded_blocks": Scenario(build=lambda: with_checkpoint_inside(seeded_transformer())),
    "meta_device_init": Scenario(build=_meta_init(), shard=_materialize_and_load,
                                 reference_build=seeded_transformer),
    "meta_device_init_unit_by_unit": Scenario(build=_meta_init(), shard=_materialize_unit_by_unit,
                                              reference_build=seeded_transformer),
    "cpu_offload": Scenario(shard=_offload),
    "explicit_prefetch": Scenario(shard=_explicit_prefetch, forward=_unshard_then_forward),
    "async_unshard": Scenario(shard=_async_unshard, forward=_async_handle_forward),
    "no_grad_forward_between_steps": Scenario(forward=_no_grad_forward_first),
    "hsdp_reduce_scatter_only_accumulation": Scenario(shape=(2, 2), micro_steps=2,
                                                      before_backward=_hsdp_reduce_scatter_only),
    "no_shard_mesh": Scenario(shape=(2, 1)),
    "bf16_mixed_precision": Scenario(shard=_mixed_precision),
    # 2-D: tensor parallelism inside the blocks, FSDP over dp (HSDP: dp_replicate x dp_shard)
    "tp_fsdp_2x2": _tp_scenario((2, 2)),
    "hsdp_tp_1x2x2": _tp_scenario((1, 2, 2)),
    "tp_sequence_parallel_fsdp_2x2": _tp_scenario((2, 2), sequence_parallel=True),
}


def make_mesh(shape, names=None):
    if names is not None:
        return init_device_mesh("cpu", shape, mesh_dim_names=names)
    if len(shape) == 1:
        return init_device_mesh("cpu", shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def data_parallel_dims(mesh) -> tuple[str, ...]:
    return tuple(name for name in mesh.mesh_dim_names if name.startswith("dp"))


def data_parallel_coordinates(mesh) -> tuple[int, int] | None:
    """``(dp_rank, dp_size)`` of this rank over the mesh's "dp*" dims (None: every rank)."""
    if mesh.mesh_dim_names is None or "tp" not in mesh.mesh_dim_names:
        return None
    rank, size = 0, 1
    for name in data_parallel_dims(mesh):
        rank = rank * mesh[name].size() + mesh[name].get_local_rank()
        size *= mesh[name].size()
    return rank, size


def _train(scenario: Scenario, api) -> tuple[nn.Module, list[float]]:
    mesh = make_mesh(scenario.shape, scenario.mesh_names)
    model = scenario.shard(scenario.build(), api, mesh)
    losses = train_sharded(model, STEPS, micro_steps=scenario.micro_steps, set_to_none=scenario.set_to_none,
                           forward=scenario.forward, before_backward=scenario.before_backward,
                           sync_each_micro_step=scenario.sync_each_micro_step,
                           data_parallel=data_parallel_coordinates(mesh), clip=scenario.clip)
    return model, losses


def run_scenario(name: str) -> dict:
    """On each rank: train with shardkit and with torch's fully_shard."""
    scenario = SCENARIOS[name]
    ours, our_losses = _train(scenario, shardkit_api())
    theirs, their_losses = _train(scenario, torch_api())
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    return {
        "rank": dist.get_rank(),
        "losses": our_losses,
        "torch_losses": their_losses,
        "bitwise_equal_to_torch": {k: torch.equal(v.to_local(), theirs_sd[k].to_local()) for k, v in ours_sd.items()},
        "layout_equal_to_torch": {k: (v.device_mesh, v.placements, v.shape) ==
                                  (theirs_sd[k].device_mesh, theirs_sd[k].placements, theirs_sd[k].shape)
                                  for k, v in ours_sd.items()},
        "placements": {k: tuple(map(str, v.placements)) for k, v in ours_sd.items()},
        "requires_grad": {k: p.requires_grad for k, p in ours.named_parameters()},
    }


def reference_losses(name: str) -> list[float]:
    scenario = SCENARIOS[name]
    model = (scenario.reference_build or scenario.build)()
    losses, _ = train_reference(model, scenario.data_parallel_world, STEPS, micro_steps=scenario.micro_steps,
                                set_to_none=scenario.set_to_none)
    return losses
