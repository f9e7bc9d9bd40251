"""The full SPMD mesh and per-parameter placements, against torch's own ``fully_shard``.

``fully_shard(model, mesh=world, dp_mesh_dims=DataParallelMeshDims(...))``
over parameters that are already DTensors on the whole mesh (``Replicate()``
on the data-parallel dims, tensor-parallel placements on the others), and a
``shard_placement_fn`` that puts some parameters of one group on a mesh of
their own or keeps them replicated.  Every test builds the same model twice,
shards one copy with torch and one with shardkit on the same mesh, and
trains both on the same inputs: the placements of every parameter, every
gradient and every parameter after each step are equal, bitwise (every
reduction here sums two values, so the order of the sum cannot differ).

DTensor caches sharding decisions by mesh *equality*, so a parameter
distributed on a mesh equal to one built earlier in the same process could come
back on that earlier mesh object, while ``fully_shard`` (torch's and ours)
requires the very object passed as ``mesh``.  Within one rank call every
(shape, names) has one mesh (``_meshes``); between calls, ``run_on_ranks``
empties those caches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from tests.support.dist import run_on_ranks

IN, HIDDEN, OUT, BATCH = 8, 12, 6, 8

# (mesh shape, dim names, dp_mesh_dims as (shard, replicate), each parameter's non-dp placement)
TP = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1), "2.bias": Replicate()}
PLAIN = {name: None for name in TP}
SPMD_VARIANTS = {
    "fsdp+tp": ((2, 2), ("dp", "tp"), ("dp", None), TP),
    "hsdp": ((2, 2), ("dpr", "dps"), ("dps", "dpr"), PLAIN),
    "flattened shard dims": ((2, 2), ("dpr", "dps"), (("dpr", "dps"), None), PLAIN),
    "replicate+tp": ((2, 2), ("dp", "tp"), (None, "dp"), TP),
}


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def _on_full_mesh(model: nn.Module, mesh, dp_names: tuple[str, ...], tp: dict) -> nn.Module:
    """Every parameter a DTensor on the whole mesh: Replicate() on the dp dims, its TP placement on the rest."""
    for name, param in list(model.named_parameters()):
        placements = [Replicate() if d in dp_names else tp[name] for d in mesh.mesh_dim_names]
        owner, leaf = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        setattr(owner, leaf, nn.Parameter(distribute_tensor(param.detach(), mesh, placements)))
    return model


def _batch(step: int, mesh, dp_names: tuple[str, ...]) -> DTensor:
    torch.manual_seed(100 + step)
    x = torch.randn(BATCH, IN)
    return distribute_tensor(x, mesh, [Shard(0) if d in dp_names else Replicate() for d in mesh.mesh_dim_names])


def _layout(model: nn.Module) -> dict:
    return {name: (p.device_mesh.mesh_dim_names, p.device_mesh.mesh.tolist(), tuple(p.placements))
            for name, p in model.named_parameters()}


def _train(model: nn.Module, mesh, dp_names, steps: int = 3) -> list[dict]:
    """Per step: each parameter's local gradient and local value after the step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    history = []
    for step in range(steps):
        out = model(_batch(step, mesh, dp_names))
        (out * out).mean().backward()
        grads = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        history.append({"grads": grads,
                        "params": {name: p.to_local().detach().clone() for name, p in model.named_parameters()}})
    return history


def _meshes(variants) -> dict:
    """One mesh per (shape, names), shared by every run: DTensor caches sharding
    decisions by mesh equality, so a second equal mesh would meet the first one's
    specs, and fully_shard wants the parameters' own mesh object."""
    meshes = {}
    for shape, names, *_ in (SPMD_VARIANTS[v] for v in variants):
        if (shape, names) not in meshes:
            meshes[shape, names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return meshes


def _spmd_runs(variant: str, impl: str, meshes: dict):
    from torch.distributed.fsdp import DataParallelMeshDims

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from shardkit import fully_shard
    shape, names, (shard, replicate), tp = SPMD_VARIANTS[variant]
    mesh = meshes[shape, names]
    dims = DataParallelMeshDims(shard=shard, replicate=replicate)
    dp_names = (*dims.shard_names, *dims.replicate_names)
    model = _on_full_mesh(_mlp(0), mesh, dp_names, tp)
    fully_shard(model[0], mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    return _layout(model), _train(model, mesh, dp_names)


def _torch_and_shardkit_spmd(variants: list[str]) -> dict:
    meshes = _meshes(variants)
    return {v: {impl: _spmd_runs(v, impl, meshes) for impl in ("torch", "shardkit")} for v in variants}


def _equal_histories(a: list[dict], b: list[dict]) -> list[str]:
    return [f"step {step} {kind} {name}" for step, (x, y) in enumerate(zip(a, b)) for kind in ("grads", "params")
            for name in x[kind] if not torch.equal(x[kind][name], y[kind][name])]


def test_dp_mesh_dims_gives_torchs_placements_gradients_and_parameters_on_the_full_spmd_mesh():
    results = run_on_ranks(4, _torch_and_shardkit_spmd, list(SPMD_VARIANTS))
    for rank, per_variant in enumerate(results):
        for variant, runs in per_variant.items():
            (torch_layout, torch_history), (ours_layout, ours_history) = runs["torch"], runs["shardkit"]
            assert ours_layout == torch_layout, (rank, variant)
            assert _equal_histories(torch_history, ours_history) == [], (rank, variant)
    layouts = {variant: runs["shardkit"][0] for variant, runs in results[0].items()}
    assert layouts["fsdp+tp"]["0.weight"][2] == (_StridedShard(0, split_factor=2), Shard(0))  # tp cut rows first
    assert layouts["fsdp+tp"]["2.weight"][2] == (Shard(0), Shard(1))
    assert layouts["hsdp"]["0.weight"][2] == (Replicate(), Shard(0))
    assert layouts["flattened shard dims"]["0.weight"][:2] == (("dpr_dps",), [0, 1, 2, 3])
    assert layouts["replicate+tp"]["2.weight"][2] == (Replicate(), Shard(1))


# ------------------------------------------------------- per-parameter placements


def _placement_fns(meshes: dict) -> dict:
    """name -> (torch's shard_placement_fn, shardkit's).  "2.weight" leaves the
    group's 4-rank mesh: sharded over 2 ranks and replicated over the other 2,
    or kept whole on every rank.  torch has no Replicate(); its equivalent is a
    (4, 1) mesh whose one-rank shard groups hold the whole tensor."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult

    hsdp = HSDPMeshInfo(meshes["hsdp"], shard_mesh_dim=1, replicate_mesh_dim=0)
    whole = HSDPMeshInfo(meshes["whole"], shard_mesh_dim=1, replicate_mesh_dim=0)

    def on(info):
        return lambda p: ShardPlacementResult(Shard(0), info) if p.shape == (OUT, HIDDEN) else None

    def built_per_call(p):
        """A new mesh info object on every call, each dropped once used (so its id() may come back).
        torch refuses it (it wants one object per process group); its equivalent shares the objects."""
        if p.shape == (OUT, HIDDEN):
            return ShardPlacementResult(Shard(0), HSDPMeshInfo(meshes["hsdp"], shard_mesh_dim=1, replicate_mesh_dim=0))
        return ShardPlacementResult(Shard(0), FSDPMeshInfo(meshes["dp"], shard_mesh_dim=0))

    ours_replicate = lambda p: Replicate() if p.shape == (OUT, HIDDEN) else None  # noqa: E731
    return {"own mesh": (on(hsdp), on(hsdp)), "Replicate()": (on(whole), ours_replicate),
            "mesh infos built per call": (on(hsdp), built_per_call)}


def _per_param_runs() -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardkit import fully_shard

    meshes = {"dp": init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)),
              "hsdp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")),
              "whole": init_device_mesh("cpu", (4, 1), mesh_dim_names=("rep", "shard"))}
    results = {}
    for variant, fns in _placement_fns(meshes).items():
        for impl, shard, fn in (("torch", torch_fully_shard, fns[0]), ("shardkit", fully_shard, fns[1])):
            model = _mlp(0)
            shard(model, mesh=meshes["dp"], shard_placement_fn=fn)
            results[variant, impl] = _layout(model), _train_local(model)
    return results


def _train_local(model: nn.Module, steps: int = 3) -> list[dict]:
    """Like ``_train``, on this rank's own plain batch, comparing full gradients and parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    history = []
    for step in range(steps):
        torch.manual_seed(100 * step + dist.get_rank())
        out = model(torch.randn(BATCH // 4, IN))
        (out * out).mean().backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        history.append({"grads": grads,
                        "params": {name: p.detach().full_tensor() for name, p in model.named_parameters()}})
    return history


def test_shard_placement_fn_mixes_meshes_and_replicate_in_one_group_as_torch_does():
    for rank, results in enumerate(run_on_ranks(4, _per_param_runs)):
        for variant in ("own mesh", "Replicate()", "mesh infos built per call"):
            (torch_layout, torch_history), (ours_layout, ours_history) = (results[variant, impl]
                                                                          for impl in ("torch", "shardkit"))
            assert _equal_histories(torch_history, ours_history) == [], (rank, variant)
            assert {k: v for k, v in ours_layout.items() if k != "2.weight"} == \
                {k: v for k, v in torch_layout.items() if k != "2.weight"}
            assert ours_layout["0.weight"] == (("dp",), [0, 1, 2, 3], (Shard(0),))
        assert results["own mesh", "shardkit"][0]["2.weight"] == results["own mesh", "torch"][0]["2.weight"] \
            == (("rep", "shard"), [[0, 1], [2, 3]], (Replicate(), Shard(0)))
        assert results["Replicate()", "shardkit"][0]["2.weight"] == (("dp",), [0, 1, 2, 3], (Replicate(),))
        assert results["mesh infos built per call", "shardkit"][0] == results["own mesh", "torch"][0]  # whole layout


# ------------------------------------------------------------------- misuse


def _spmd_misuses() -> dict:
    """impl -> case -> (the builtin exception types raised, the message)."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardkit import fully_shard as shardkit_fully_shard

    mesh = _meshes(["fsdp+tp"])[(2, 2), ("dp", "tp")]
    unnamed = init_device_mesh("cpu", (2, 2))
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))  # same ranks, another object
    dp = DataParallelMeshDims(shard="dp")

    def sharded_on_dp() -> nn.Module:
        model = _mlp(0)
        model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Shard(0), Replicate()]))
        return model[0]

    out = {}
    for impl, fully_shard in (("torch", torch_fully_shard), ("shardkit", shardkit_fully_shard)):
        cases = {
            "plain parameters": lambda: fully_shard(_mlp(0), mesh=mesh, dp_mesh_dims=dp),
            "mesh without names": lambda: fully_shard(_mlp(0), mesh=unnamed, dp_mesh_dims=dp),
            "unknown dim name": lambda: fully_shard(_on_full_mesh(_mlp(0), mesh, ("dp",), TP), mesh=mesh,
                                                    dp_mesh_dims=DataParallelMeshDims(shard="x")),
            "sharded on a dp dim": lambda: fully_shard(sharded_on_dp(), mesh=mesh, dp_mesh_dims=dp),
            "int reshard_after_forward": lambda: fully_shard(_on_full_mesh(_mlp(0), mesh, ("dp",), TP), mesh=mesh,
                                                             dp_mesh_dims=dp, reshard_after_forward=2),
            "another mesh object": lambda: fully_shard(_on_full_mesh(_mlp(0), other, ("dp",), TP), mesh=mesh,
                                                       dp_mesh_dims=dp),
        }
        out[impl] = {}
        for name, call in cases.items():
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the type is what is compared
                out[impl][name] = ([c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"], str(exc))
            else:
                out[impl][name] = None
    return out


def test_dp_mesh_dims_misuse_raises_torchs_builtin_with_torchs_wording_first():
    results = run_on_ranks(4, _spmd_misuses)[0]
    theirs, ours = results["torch"], results["shardkit"]
    for case, (torch_types, torch_message) in theirs.items():
        our_types, our_message = ours[case]
        assert torch_types[0] in our_types, (case, torch_types, our_types)
        first_sentence = torch_message.split(". ")[0].split(";")[0]
        assert our_message.startswith(first_sentence), (case, torch_message, our_message)
    assert theirs["int reshard_after_forward"][0][0] == "NotImplementedError"
    assert theirs["plain parameters"][0][0] == "ValueError"
    assert theirs["another mesh object"][0][0] == "ValueError"


# --------------------------------------------------------------- checkpoints


def _save_and_load_spmd(url: str) -> dict:
    """A shardkit model trained on the (dp, tp) SPMD mesh is saved with shardkit.checkpoint and
    loaded into a fresh (differently seeded) shardkit model and into torch's, same mesh."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardkit.checkpoint as skc
    from shardkit import fully_shard

    mesh = _meshes(["fsdp+tp"])[(2, 2), ("dp", "tp")]
    dims = DataParallelMeshDims(shard="dp")

    def build(shard, seed):
        model = _on_full_mesh(_mlp(seed), mesh, ("dp",), TP)
        shard(model, mesh=mesh, dp_mesh_dims=dims)
        return model

    model = build(fully_shard, 0)
    _train(model, mesh, ("dp",), steps=1)
    skc.save(model.state_dict(), url)
    saved = {name: p.detach().full_tensor() for name, p in model.named_parameters()}
    loaded = {}
    for impl, shard in (("shardkit", fully_shard), ("torch", torch_fully_shard)):
        fresh = build(shard, 1)
        state = fresh.state_dict()
        skc.load(state, url)
        loaded[impl] = [name for name, p in fresh.named_parameters()
                        if not torch.equal(p.detach().full_tensor(), saved[name])]
        loaded[impl + " placements"] = _layout(fresh)
    return loaded


def test_a_dp_mesh_dims_model_round_trips_through_a_shardkit_checkpoint_into_shardkit_and_torch(tmp_path):
    for result in run_on_ranks(4, _save_and_load_spmd, str(tmp_path / "spmd")):
        assert result["shardkit"] == [] and result["torch"] == []
        assert result["shardkit placements"] == result["torch placements"]


def _replicate_spmd_runs() -> dict:
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
    from torch.distributed.fsdp import DataParallelMeshDims

    from shardkit import replicate

    mesh = _meshes(["replicate+tp"])[(2, 2), ("dp", "tp")]
    dims = DataParallelMeshDims(replicate="dp")
    runs = {}
    for impl, apply in (("torch", torch_replicate), ("shardkit", replicate)):
        model = _on_full_mesh(_mlp(0), mesh, ("dp",), TP)
        apply(model, mesh=mesh, dp_mesh_dims=dims)
        runs[impl] = _layout(model), _train(model, mesh, ("dp",))
    return runs


def test_replicate_with_dp_mesh_dims_matches_torchs_replicate_on_the_full_spmd_mesh():
    for rank, runs in enumerate(run_on_ranks(4, _replicate_spmd_runs)):
        (torch_layout, torch_history), (ours_layout, ours_history) = runs["torch"], runs["shardkit"]
        assert ours_layout == torch_layout, rank
        assert ours_layout["0.weight"] == (("dp", "tp"), [[0, 1], [2, 3]], (Replicate(), Shard(0)))
        assert _equal_histories(torch_history, ours_history) == [], rank
