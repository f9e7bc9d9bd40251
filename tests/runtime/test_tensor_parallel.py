"""2-D meshes: ``fully_shard(block, mesh=world["dp"])`` over parameters that
tensor parallelism made DTensors on ``world["tp"]``.

Training parity (losses against one process, parameters bitwise against
torch's own ``fully_shard``, same placements) runs with the other training
modes: the ``tp_*`` scenarios of ``tests/runtime/test_training_modes.py``.
Here: the layout itself, which collectives run over which ranks, and DCP
checkpoints crossing between shardkit and torch.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.dist import run_on_ranks
from tests.support.models import TP_ARGS, lm_loss, parallelize_blocks
from tests.support.runtime_common import local_batch, seeded_transformer
from tests.support.runtime_scenarios import per_block, shardkit_api, torch_api


def _two_d(api, shape=(2, 2), names=("dp", "tp"), seed=0):
    """The seeded TP transformer: TP in every block over "tp", then FSDP per block
    and the root over the data-parallel dims."""
    world = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = parallelize_blocks(seeded_transformer(seed, args=TP_ARGS), world["tp"])
    return per_block(model, api, world[tuple(n for n in names if n.startswith("dp"))]), world


def _layouts(shape, names):
    model, _ = _two_d(shardkit_api(), shape, names)
    full = seeded_transformer(args=TP_ARGS).state_dict()
    return {
        name: {"mesh": param.device_mesh.mesh_dim_names, "placements": tuple(param.placements),
               "local_rows": param.to_local().shape[0], "full_equals_unsharded": torch.equal(param.full_tensor(),
                                                                                           full[name])}
        for name, param in model.named_parameters()
    }


def test_tp_parameters_compose_fsdp_dim0_shard_with_tp_placement_as_torch_does():
    strided = _StridedShard(0, split_factor=2)
    for shape, names, dp in [((2, 2), ("dp", "tp"), ()),
                             ((1, 2, 2), ("dp_replicate", "dp_shard", "tp"), (Replicate(),))]:
        layouts = run_on_ranks(4, _layouts, shape, names)
        for rank, layout in enumerate(layouts):
            assert all(entry["full_equals_unsharded"] for entry in layout.values())
            wq, wo, bo = (layout[f"layers.1.attention.{n}"] for n in ("wq.weight", "wo.weight", "wo.bias"))
            w1_bias, norm = layout["layers.1.feed_forward.w1.bias"], layout["layers.1.ffn_norm.weight"]
            assert wq["mesh"] == wo["mesh"] == names
            assert wq["placements"] == (*dp, strided, Shard(0))  # TP cut the 26 rows first, dp the 13 next
            assert wo["placements"] == (*dp, Shard(0), Shard(1))
            assert bo["placements"] == (*dp, Shard(0), Replicate())
            assert w1_bias["placements"] == (*dp, strided, Shard(0))
            assert norm["mesh"] == names[:-1] and norm["placements"] == (*dp, Shard(0))  # not TP'd: dp only
            dp_rank = (rank // 2) % 2
            assert wq["local_rows"] == (7, 6)[dp_rank]          # 26 rows / tp 2 = 13, over dp 2: 7 and 6
            assert w1_bias["local_rows"] == (13, 12)[dp_rank]   # 50 / 2 = 25: 13 and 12


class _CollectivesByGroup(TorchDispatchMode):
    """Counts collectives per (op, ranks of the group they run over)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            values = [*args, *(kwargs or {}).values()]
            groups = [dist.ProcessGroup.unbox(v) for v in values
                      if isinstance(v, torch.ScriptObject) and "ProcessGroup" in str(v._type())]
            groups += [dist.distributed_c10d._resolve_process_group(v) for v in values
                       if isinstance(v, str) and func.namespace == "_c10d_functional" and v.isdigit()]
            if groups:
                self.counts[(func._opname, tuple(dist.get_process_group_ranks(groups[0])))] += 1
        return func(*args, **(kwargs or {}))


def _collectives_of_one_step():
    out = {}
    for api in (shardkit_api(), torch_api()):
        model, world = _two_d(api)
        tokens, targets = local_batch(0, 2, world["dp"].get_local_rank())
        with _CollectivesByGroup() as seen:
            lm_loss(model(tokens), targets).backward()
        out[api.name] = dict(seen.counts)
    return dist.get_rank(), out


def test_fsdp_collectives_run_over_dp_and_tp_collectives_stay_tps_exactly_as_torchs():
    for rank, seen in run_on_ranks(4, _collectives_of_one_step):
        ours = seen["shardkit"]
        dp_ranks, tp_ranks = ((0, 2), (1, 3))[rank % 2], ((0, 1), (2, 3))[rank // 2]
        assert ours == seen["torch"]
        # 4 groups: forward all-gathers (root kept) + 3 backward ones; 4 reduce-scatters; all over dp
        assert ours[("_allgather_base_", dp_ranks)] == 7 and ours[("_reduce_scatter_base_", dp_ranks)] == 4
        assert {ranks for _, ranks in ours} == {dp_ranks, tp_ranks}
        assert all(op in ("all_reduce", "wait_tensor") for op, ranks in ours if ranks == tp_ranks)


def _dcp_round_trip(path):
    import torch.distributed.checkpoint as dcp

    ours, _ = _two_d(shardkit_api(), seed=1)
    theirs, _ = _two_d(torch_api(), seed=2)
    dcp.save(ours.state_dict(), checkpoint_id=f"{path}/ours")
    into_torch = theirs.state_dict()
    dcp.load(into_torch, checkpoint_id=f"{path}/ours")
    theirs.load_state_dict(into_torch)
    loaded_by_torch = all(torch.equal(a.full_tensor(), b.full_tensor())
                          for a, b in zip(ours.parameters(), theirs.parameters()))
    fresh, _ = _two_d(shardkit_api(), seed=3)
    dcp.save(theirs.state_dict(), checkpoint_id=f"{path}/theirs")
    into_ours = fresh.state_dict()
    dcp.load(into_ours, checkpoint_id=f"{path}/theirs")
    fresh.load_state_dict(into_ours)
    loaded_by_shardkit = all(torch.equal(a.to_local(), b.to_local())
                             for a, b in zip(fresh.parameters(), theirs.parameters()))
    return loaded_by_torch, loaded_by_shardkit


def test_dcp_checkpoint_of_a_2d_model_loads_into_torchs_2d_model_and_back(tmp_path):
    assert run_on_ranks(4, _dcp_round_trip, str(tmp_path)) == [(True, True)] * 4


def _full_state_loads_through_distribute_tensor():
    model, _ = _two_d(shardkit_api(), seed=4)
    full = seeded_transformer(5, args=TP_ARGS).state_dict()
    current = model.state_dict()
    # every rank holds the full tensors: cut locally (torch's scatter from one rank
    # rejects uneven _StridedShard pieces)
    model.load_state_dict({k: distribute_tensor(v, current[k].device_mesh, current[k].placements,
                                                src_data_rank=None) for k, v in full.items()})
    tokens, targets = local_batch(0, 2, dist.get_rank() // 2)
    lm_loss(model(tokens), targets).backward()  # trains after the load: the shards were re-padded
    return all(torch.equal(p.full_tensor(), full[k]) for k, p in model.named_parameters()), \
        all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_full_state_dict_distributed_with_the_2d_placements_loads_in_place():
    assert run_on_ranks(4, _full_state_loads_through_distribute_tensor) == [(True, True)] * 4


def _bf16_and_reshard_to_two_ranks(option):
    """A few steps with one more option on both implementations (or shardkit alone
    when torch has no such option for TP parameters)."""
    from tests.support.runtime_common import train_sharded
    from tests.support.runtime_scenarios import shardkit_clip

    out = {}
    for api in (shardkit_api(), torch_api()):
        if option == "reshard_after_forward_2" and api.name == "torch":
            continue  # torch: "Resharding to smaller mesh is not supported for DTensor parameters yet"
        kwargs = ({"mp_policy": api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
                  if option == "bf16" else {"reshard_after_forward": 2})
        shape, names = ((2, 2), ("dp", "tp")) if option == "bf16" else ((4, 1), ("dp", "tp"))
        world = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = parallelize_blocks(seeded_transformer(args=TP_ARGS), world["tp"])
        for layer in model.layers:
            api.fully_shard(layer, mesh=world["dp"], **kwargs)
        api.fully_shard(model, mesh=world["dp"], **{k: v for k, v in kwargs.items() if k == "mp_policy"})
        losses = train_sharded(model, 3, clip=shardkit_clip,
                               data_parallel=(world["dp"].get_local_rank(), world["dp"].size()))
        out[api.name] = (losses, [p.to_local().detach().clone() for p in model.parameters()])
    return out


def test_bf16_compute_on_tp_parameters_equals_torchs_bitwise():
    for out in run_on_ranks(4, _bf16_and_reshard_to_two_ranks, "bf16"):
        (ours, our_params), (theirs, their_params) = out["shardkit"], out["torch"]
        assert ours == theirs
        assert all(torch.equal(a, b) for a, b in zip(our_params, their_params))


def test_reshard_after_forward_to_two_ranks_works_for_tp_parameters():
    from tests.support.runtime_common import max_relative_loss_error, train_reference

    reference, _ = train_reference(seeded_transformer(args=TP_ARGS), 4, 3)
    for out in run_on_ranks(4, _bf16_and_reshard_to_two_ranks, "reshard_after_forward_2"):
        assert max_relative_loss_error(out["shardkit"][0], reference) <= 1e-6


def _misuses():
    import torch.nn as nn

    from shardkit import fully_shard

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    errors = {}

    def record(name, build):
        try:
            build()
        except Exception as exc:  # noqa: BLE001 - the test inspects what came out
            errors[name] = (type(exc).__name__, str(exc))

    def unnamed_tp_mesh():
        tp = DeviceMesh.from_group(world["tp"].get_group(), "cpu")  # world["tp"]'s ranks, but no names
        layer = nn.Linear(4, 4)
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), tp, [Shard(0)]))
        fully_shard(layer, mesh=world["dp"])

    def on_the_dp_mesh():
        layer = nn.Linear(4, 4)
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), world["dp"], [Shard(0)]))
        fully_shard(layer, mesh=world["dp"])

    def partial_placement():
        from torch.distributed.tensor import Partial

        layer = nn.Linear(4, 4)
        layer.weight = nn.Parameter(DTensor.from_local(layer.weight.detach(), world["tp"], [Partial()]))
        fully_shard(layer, mesh=world["dp"])

    def default_mesh_overlaps_tp():
        layer = nn.Linear(4, 4)
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), world["tp"], [Shard(0)]))
        fully_shard(layer)

    def spmd_mesh_form():
        from torch.distributed.fsdp import DataParallelMeshDims

        fully_shard(nn.Linear(4, 4), mesh=world, dp_mesh_dims=DataParallelMeshDims(shard="dp"))

    for name, build in [("unnamed_tp_mesh", unnamed_tp_mesh), ("on_the_dp_mesh", on_the_dp_mesh),
                        ("partial_placement", partial_placement), ("default_mesh", default_mesh_overlaps_tp),
                        ("dp_mesh_dims", spmd_mesh_form)]:
        record(name, build)
    return errors


def test_tp_parameters_that_cannot_compose_fail_with_an_actionable_error():
    errors = run_on_ranks(4, _misuses)[0]
    assert errors["unnamed_tp_mesh"][0] == "UnsupportedMeshError"
    assert "mesh_dim_names=('dp', 'tp')" in errors["unnamed_tp_mesh"][1]
    assert errors["on_the_dp_mesh"][0] == "UnsupportedMeshError"
    assert "already a DTensor on the data-parallel mesh" in errors["on_the_dp_mesh"][1]
    assert errors["partial_placement"][0] == "UnshardableParameterError"
    assert "redistribute it to Replicate()" in errors["partial_placement"][1]
    assert errors["default_mesh"][0] == "UnsupportedMeshError"
    assert "fully_shard's mesh has no dim names" in errors["default_mesh"][1]
    assert "pass mesh=world['dp']" in errors["default_mesh"][1]
    assert errors["dp_mesh_dims"][0] == "UnshardableParameterError"  # a ValueError, as torch's
    assert errors["dp_mesh_dims"][1].startswith("When dp_mesh_dims is provided, all parameters must be DTensors "
                                                "on the full SPMD mesh")
