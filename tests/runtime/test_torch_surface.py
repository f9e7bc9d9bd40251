"""torch 2.13's FSDPModule surface on shardkit: the same call on torch's own
``fully_shard`` and on shardkit's, same model, same inputs, equal results.

Each rank function trains a tiny three-group model twice, once per
implementation, with one ``FSDPModule`` setting applied to every sharded
module, and returns what the test compares: the sharded gradients of the
last step and the parameters after it (gathered to full tensors), plus
whatever a hook or a comm recorded.  gloo, CPU, 2 ranks (HSDP: 2x2).
"""

from __future__ import annotations

import inspect
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from tests.support.dist import run_on_ranks

STEPS = 2


def _fully_shard(impl: str):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from shardkit import fully_shard
    return fully_shard


def _mesh(shape: tuple[int, ...]):
    names = ("replicate", "shard") if len(shape) == 2 else ("dp",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _sharded_model(impl: str, shape: tuple[int, ...] = (2,)) -> nn.Sequential:
    """Three groups: two inner linears and the root, which owns the last one."""
    fully_shard, mesh = _fully_shard(impl), _mesh(shape)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 5))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _sharded_modules(model: nn.Sequential) -> list[nn.Module]:
    return [model[0], model[2], model]


def _train(model: nn.Module) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        torch.manual_seed(100 + 10 * step + dist.get_rank())
        model(torch.randn(4, 8)).pow(2).sum().backward()
        grads = {f"grad {n}": p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {**grads, **{f"param {n}": p.detach().full_tensor() for n, p in model.named_parameters()}}


class _Recorder:
    """An all-reduce hook that records what it is given, then halves it in place."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.seen.append(reduce_output.clone())
        reduce_output.mul_(0.5)


class _CountingReduceScatter:
    """A user-owned reduce-scatter that does what the default does, and counts."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (input numel, output numel)

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append((input_tensor.numel(), output_tensor.numel()))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class _CountingAllGather:
    """A user-owned all-gather that does what the default does, and counts."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append((input_tensor.numel(), output_tensor.numel()))
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _configure(model: nn.Sequential, setting: str) -> list:
    """Apply ``setting`` to every sharded module; return what gets recorded."""
    records: list = []
    for module in _sharded_modules(model):
        if setting == "all_reduce_hook":
            records.append(_Recorder())
            module.set_all_reduce_hook(records[-1])
        elif setting == "force_sum_with_factor_and_hook":
            records.append(_Recorder())
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(3.0)
            module.set_all_reduce_hook(records[-1])
        elif setting == "divide_factor_on_the_root_only":
            module.set_force_sum_reduction_for_comms(True)
            if module is model:
                module.set_gradient_divide_factor(3.0)
        elif setting == "deprecated_divide_factor":
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM: torch needs SUM here
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module.set_reduce_scatter_divide_factor(3.0)
            records.append([(w.category.__name__, str(w.message)) for w in caught])
        elif setting == "custom_reduce_scatter":
            records.append(_CountingReduceScatter())
            module.set_custom_reduce_scatter(records[-1])
        elif setting == "custom_all_gather":
            records.append(_CountingAllGather())
            module.set_custom_all_gather(records[-1])
        elif setting == "process_group_memory":
            module.set_allocate_memory_from_process_group_for_comm(True)
        elif setting == "separate_reduce_scatter_group":
            module.set_separate_reduce_scatter_group()
        elif setting == "max_input_buffers":
            module.set_reduce_scatter_max_input_buffers(2)
        elif setting == "unshard_async_op":
            module._set_unshard_async_op(True)
        elif setting != "defaults":
            raise AssertionError(f"unknown setting {setting}")
    return records


def _recorded(records: list) -> list:
    out = []
    for r in records:
        out.append(r.seen if isinstance(r, _Recorder) else r.calls if hasattr(r, "calls") else r)
    return out


def _effects(impl: str, model: nn.Sequential) -> dict[str, list]:
    """What each setting changed, read through torch's state names on every group."""
    if impl == "torch":
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            ProcessGroupAllocAllGather as PgAllGather,
        )
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            ProcessGroupAllocReduceScatter as PgReduceScatter,
        )
    else:
        from shardkit.runtime.comm_hooks import ProcessGroupAllGather as PgAllGather
        from shardkit.runtime.comm_hooks import ProcessGroupReduceScatter as PgReduceScatter
    groups = [g for m in _sharded_modules(model) for g in m._get_fsdp_state()._fsdp_param_groups]
    return {
        "process_group_memory": [(isinstance(g._all_gather_comm, PgAllGather),
                                  isinstance(g._reduce_scatter_comm, PgReduceScatter)) for g in groups],
        "separate_reduce_scatter_group": [
            (g._reduce_scatter_process_group is not g._all_gather_process_group,
             dist.get_process_group_ranks(g._reduce_scatter_process_group)
             == dist.get_process_group_ranks(g._all_gather_process_group)) for g in groups],
        "max_input_buffers": [g.reduce_scatter_max_input_buffers for g in groups],
        "unshard_async_op": [g.unshard_async_op for g in groups],
    }


def _both_trained(setting: str, shape: tuple[int, ...] = (2,)) -> dict[str, dict]:
    results = {}
    for impl in ("torch", "shardkit"):
        model = _sharded_model(impl, shape)
        records = _configure(model, setting)
        results[impl] = {"tensors": _train(model), "records": _recorded(records), "effects": _effects(impl, model)}
    return results


def _assert_same_training(per_rank: list[dict[str, dict]]) -> None:
    for result in per_rank:
        torch_out, ours = result["torch"], result["shardkit"]
        assert torch_out["tensors"].keys() == ours["tensors"].keys()
        for key, expected in torch_out["tensors"].items():
            assert torch.equal(ours["tensors"][key], expected), key
        assert len(ours["records"]) == len(torch_out["records"])
        for mine, theirs in zip(ours["records"], torch_out["records"]):
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("setting", [
    "all_reduce_hook",
    "force_sum_with_factor_and_hook",
    "divide_factor_on_the_root_only",
    "deprecated_divide_factor",
    "custom_reduce_scatter",
    "custom_all_gather",
    "process_group_memory",
    "separate_reduce_scatter_group",
    "max_input_buffers",
    "unshard_async_op",
])
def test_each_comm_setting_trains_exactly_as_torch_fully_shard(setting):
    results = run_on_ranks(2, _both_trained, setting)
    _assert_same_training(results)
    ours = results[0]["shardkit"]["records"]
    if setting in ("all_reduce_hook", "force_sum_with_factor_and_hook"):
        assert [len(seen) for seen in ours] == [STEPS, STEPS, STEPS]  # one call per group per backward
    if setting in ("custom_reduce_scatter", "custom_all_gather"):
        assert all(len(calls) >= STEPS for calls in ours)
    if setting == "deprecated_divide_factor":
        assert ours == [[("DeprecationWarning", "Use `set_gradient_divide_factor` instead")]] * 3
    effect_of_setting = {  # on each of the three groups, after training
        "process_group_memory": [(True, True)] * 3,  # the process-group-memory comms, all-gather and reduce-scatter
        "separate_reduce_scatter_group": [(True, True)] * 3,  # a group of its own over the shard ranks
        "max_input_buffers": [2] * 3,
        "unshard_async_op": [True] * 3,
    }
    if setting in effect_of_setting:
        for result in results:
            assert result["shardkit"]["effects"][setting] == result["torch"]["effects"][setting] \
                == effect_of_setting[setting]


class _PoolingReduceScatter(_CountingReduceScatter):
    """A user-owned reduce-scatter over a buffer pool, as a comm over registered
    memory keeps one: ``allocate`` hands out the same buffer for the same size
    and dtype every call, so a buffer is overwritten at the next reduction."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: dict[tuple, torch.Tensor] = {}

    def allocate(self, size, *, dtype, device):
        key = (tuple(size), dtype, torch.device(device))
        if key not in self.pool:
            self.pool[key] = torch.empty(*size, dtype=dtype, device=device)
        return self.pool[key]


MICRO_BATCHES = 3


def _accumulated_without_all_reduce(impl: str, shape: tuple[int, int], comm: type | None) -> dict[str, torch.Tensor]:
    """HSDP, all-reduced only at the last micro-batch."""
    model = _sharded_model(impl, shape)
    for module in _sharded_modules(model) if comm else ():
        module.set_custom_reduce_scatter(comm())
    for micro in range(MICRO_BATCHES):
        model.set_requires_all_reduce(micro == MICRO_BATCHES - 1)
        torch.manual_seed(100 + 10 * micro + dist.get_rank())
        model(torch.randn(4, 8)).pow(2).sum().backward()
    grads = {f"grad {n}": p.grad.full_tensor() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {**grads, **{f"param {n}": p.detach().full_tensor() for n, p in model.named_parameters()}}


def _pooled_and_torch(shape: tuple[int, int]) -> dict[str, dict]:
    return {"torch": _accumulated_without_all_reduce("torch", shape, None),
            "shardkit, pooling comm": _accumulated_without_all_reduce("shardkit", shape, _PoolingReduceScatter)}


@pytest.mark.parametrize("shape", [(2, 1), (2, 2)], ids=["one shard rank, its input is its output", "two shard ranks"])
def test_held_hsdp_sums_survive_a_reduce_scatter_comm_that_reuses_its_buffers(shape):
    """The default comm gives torch's gradients in the accumulation matrix; a
    pooling comm must give the same (torch's own held sum views the pooled output)."""
    for result in run_on_ranks(shape[0] * shape[1], _pooled_and_torch, shape):
        theirs, ours = result["torch"], result["shardkit, pooling comm"]
        assert list(ours) == list(theirs) and len(theirs) == 12
        for key, expected in theirs.items():
            assert torch.equal(ours[key], expected), key


class _LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.levelname, record.getMessage()))


def _settings_without_effect_on_gloo() -> dict[str, object]:
    """Each setting on every sharded module of each implementation, then a
    training run; returns what shardkit logged and both runs' results."""
    from shardkit.runtime import comm_hooks

    comm_hooks.warn_no_effect.cache_clear()  # once per process: these ranks may have seen it before
    records = _LogRecords()
    logger = logging.getLogger("shardkit.runtime.comm_hooks")
    logger.addHandler(records)
    out: dict[str, object] = {}
    try:
        for impl in ("torch", "shardkit"):
            model = _sharded_model(impl)
            hooks = [_Recorder() for _ in _sharded_modules(model)]
            for module, hook in zip(_sharded_modules(model), hooks):
                module.set_allocate_memory_from_process_group_for_comm(True)
                module.set_all_reduce_hook(hook, stream=torch.cpu.Stream())
                module.set_reduce_scatter_max_input_buffers(2)
            out[impl] = {"tensors": _train(model), "records": _recorded(hooks)}
    finally:
        logger.removeHandler(records)
    out["logged"] = records.seen
    return out


def test_settings_without_effect_on_gloo_are_taken_as_torch_takes_them_and_say_so_once():
    for result in run_on_ranks(2, _settings_without_effect_on_gloo):
        _assert_same_training([{impl: result[impl] for impl in ("torch", "shardkit")}])
        assert [level for level, _ in result["logged"]] == ["WARNING"] * 3  # three modules each: one per setting
        process_group_memory, hook_stream, max_input_buffers = (message for _, message in result["logged"])
        assert process_group_memory.startswith("set_allocate_memory_from_process_group_for_comm(True) has no "
                                               "effect here: this process group's backend has no allocator of "
                                               "its own (that needs NCCL), so collective buffers come from the "
                                               "ordinary allocator")
        assert hook_stream.startswith("set_all_reduce_hook(stream=...) has no effect on the CPU: there are no "
                                      "streams, so the hook runs inline on the caller's thread")
        assert max_input_buffers.startswith("set_reduce_scatter_max_input_buffers() has no effect on the CPU: "
                                            "reductions complete inline, so no reduce-scatter input buffer is "
                                            "ever held")


def _hsdp_hook_and_stream() -> dict[str, object]:
    out = _both_trained("all_reduce_hook", shape=(2, 2))
    for impl in ("torch", "shardkit"):
        model = _sharded_model(impl, (2, 2))
        try:
            model.set_all_reduce_hook(_Recorder(), stream=torch.cpu.Stream())
        except ValueError as e:
            out[f"{impl} stream error"] = str(e)
    return out


def test_all_reduce_hook_on_hsdp_sees_the_all_reduced_gradient_as_torch_does():
    results = run_on_ranks(4, _hsdp_hook_and_stream)
    _assert_same_training([{k: r[k] for k in ("torch", "shardkit")} for r in results])
    for r in results:
        assert r["torch stream error"] == "stream cannot be set when using native HSDP"
        assert r["shardkit stream error"].startswith("stream cannot be set when using native HSDP")


def _errors_of(impl: str) -> dict[str, tuple[str, str]]:
    model = _sharded_model(impl)
    calls = {
        "symm_mem": lambda: model.set_symm_mem_for_comm(),
        "max_input_buffers=True": lambda: model.set_reduce_scatter_max_input_buffers(True),
        "max_input_buffers=0": lambda: model.set_reduce_scatter_max_input_buffers(0),
        "process_group_memory after a custom comm": lambda: (
            model.set_custom_all_gather(_CountingAllGather()),
            model.set_allocate_memory_from_process_group_for_comm(True)),
        "share_comm_ctx of a plain module": lambda: _share_comm_ctx(impl)([model, nn.Linear(2, 2)]),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the point is which builtin it is
            out[name] = ([c.__name__ for c in type(e).__mro__
                          if c.__module__ == "builtins" and c not in (Exception, BaseException, object)], str(e))
        else:
            out[name] = ([], "")
    return out


def _share_comm_ctx(impl: str):
    if impl == "torch":
        from torch.distributed.fsdp import share_comm_ctx
    else:
        from shardkit import share_comm_ctx
    return share_comm_ctx


def _errors_both() -> dict[str, dict]:
    return {impl: _errors_of(impl) for impl in ("torch", "shardkit")}


def test_settings_gloo_cannot_honour_raise_the_builtin_torch_raises_with_its_wording_first():
    result = run_on_ranks(2, _errors_both)[0]
    theirs, ours = result["torch"], result["shardkit"]
    assert {k: v[0] for k, v in theirs.items()} == {
        "symm_mem": ["RuntimeError"],
        "max_input_buffers=True": ["TypeError"],
        "max_input_buffers=0": ["ValueError"],
        "process_group_memory after a custom comm": ["AssertionError"],
        "share_comm_ctx of a plain module": ["ValueError"],
    }
    assert {k: theirs[k][0][0] in v[0] for k, v in ours.items()} == dict.fromkeys(theirs, True)
    for name, (_, message) in theirs.items():
        assert ours[name][1].startswith(message.split(":")[0]), name
    assert "needs NCCL" in ours["symm_mem"][1]


def _shared_context_training(impl: str) -> dict[str, object]:
    first, second = _sharded_model(impl), _sharded_model(impl)
    _share_comm_ctx(impl)([first, second])
    out = {"first": _train(first), "second": _train(second)}
    if impl == "shardkit":
        contexts = {id(first._get_fsdp_state().comm), id(second._get_fsdp_state().comm),
                    id(second[0]._get_fsdp_state().comm)}
    else:
        contexts = {id(first._get_fsdp_state()._comm_ctx), id(second._get_fsdp_state()._comm_ctx),
                    id(second[0]._get_fsdp_state()._comm_ctx)}
    out["contexts"] = len(contexts)
    return out


def _shared_both() -> dict[str, dict]:
    return {impl: _shared_context_training(impl) for impl in ("torch", "shardkit")}


def test_share_comm_ctx_gives_two_roots_one_context_and_torch_s_results():
    for result in run_on_ranks(2, _shared_both):
        theirs, ours = result["torch"], result["shardkit"]
        assert ours["contexts"] == theirs["contexts"] == 1
        for root in ("first", "second"):
            for key, expected in theirs[root].items():
                assert torch.equal(ours[root][key], expected), (root, key)


def _state_as_frameworks_read_it(impl: str) -> dict[str, object]:
    fully_shard = _fully_shard(impl)
    model = _sharded_model(impl)
    model.set_gradient_divide_factor(2.0)
    plain = nn.Linear(2, 2)
    _train(model)
    state = fully_shard.state(model)
    group = state._fsdp_param_group
    inner = fully_shard.state(model[0])
    return {
        "same as _get_fsdp_state": state is model._get_fsdp_state(),
        "plain module": fully_shard.state(plain),
        "roots": (state._is_root, inner._is_root),
        "groups": len(state._fsdp_param_groups),
        "fqns": [p._param_fqn for p in group.fsdp_params],
        "shards": [p.sharded_param.to_local().detach() for p in group.fsdp_params],
        "unsharded after step": [p._unsharded_param is not None and p._unsharded_param.untyped_storage().size() > 0
                                 for p in inner._fsdp_param_group.fsdp_params],
        "knobs": (group.gradient_divide_factor, group.force_sum_reduction_for_comms, group.reduce_grads,
                  group.all_reduce_grads, group.reduce_scatter_unused_params, group.unshard_async_op),
        "module fqn": inner._fsdp_param_group._module_fqn,
    }


def _state_both() -> dict[str, dict]:
    return {impl: _state_as_frameworks_read_it(impl) for impl in ("torch", "shardkit")}


def test_fully_shard_state_offers_the_attributes_frameworks_read():
    for result in run_on_ranks(2, _state_both):
        theirs, ours = result["torch"], result["shardkit"]
        assert ours["same as _get_fsdp_state"] and theirs["same as _get_fsdp_state"]
        assert ours["plain module"] is None and theirs["plain module"] is None
        assert ours["roots"] == theirs["roots"] == (True, False)
        assert ours["groups"] == theirs["groups"] == 1
        assert ours["fqns"] == theirs["fqns"] == ["4.weight", "4.bias"]
        assert all(torch.equal(a, b) for a, b in zip(ours["shards"], theirs["shards"]))
        assert ours["unsharded after step"] == theirs["unsharded after step"]
        assert ours["knobs"] == theirs["knobs"] == (2.0, False, True, True, False, False)
        assert ours["module fqn"] == theirs["module fqn"] == "0"


_TORCH_PRIVATE_METHODS_FRAMEWORKS_CALL = ("_get_fsdp_state", "_set_unshard_async_op")


def _public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(value) for name, value in vars(cls).items()
            if callable(value) and (not name.startswith("_") or name in _TORCH_PRIVATE_METHODS_FRAMEWORKS_CALL)}


def _shape(signature: inspect.Signature) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def test_every_fsdp_module_method_of_torch_exists_on_shardkit_with_the_same_parameters():
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from shardkit import FSDPModule

    theirs = _public_methods(TorchFSDPModule)
    assert len(theirs) >= 25
    ours = {name: inspect.signature(getattr(FSDPModule, name)) for name in theirs if hasattr(FSDPModule, name)}
    assert sorted(ours) == sorted(theirs)
    assert {n: _shape(s) for n, s in ours.items()} == {n: _shape(s) for n, s in theirs.items()}


FSDP2_NAMES = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "MixedPrecisionPolicy",
               "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims", "share_comm_ctx"]


def test_every_fsdp2_name_torch_exports_is_importable_from_shardkit_and_its_runtime():
    import torch.distributed.fsdp as torch_fsdp

    import shardkit
    import shardkit.runtime

    assert set(FSDP2_NAMES) <= set(torch_fsdp.__all__)
    assert [n for n in FSDP2_NAMES if not hasattr(shardkit, n)] == []
    assert [n for n in FSDP2_NAMES if n not in shardkit.runtime.__all__] == []
    assert [n for n in FSDP2_NAMES if n not in shardkit.__all__] == []


def test_data_parallel_mesh_dims_has_torch_s_fields_and_refuses_neither_dim():
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

    from shardkit import DataParallelMeshDims

    ours, theirs = DataParallelMeshDims(shard=("a", "b"), replicate="r"), TorchDims(shard=("a", "b"), replicate="r")
    assert (ours.shard, ours.replicate, ours.shard_names, ours.replicate_names) == \
        (theirs.shard, theirs.replicate, theirs.shard_names, theirs.replicate_names)
    with pytest.raises(ValueError, match="^At least one of shard or replicate must be set in DataParallelMeshDims"):
        DataParallelMeshDims()
    with pytest.raises(ValueError, match="^At least one of shard or replicate must be set in DataParallelMeshDims"):
        TorchDims()


def _lazy_init_as_frameworks_see_it(impl: str) -> dict[str, object]:
    fully_shard = _fully_shard(impl)
    model = _sharded_model(impl)
    states = [fully_shard.state(m) for m in (model, model[0], model[2])]
    before = [set(s._modules_to_run_forward) for s in states]
    states[0]._lazy_init()
    ctx = states[0]._state_ctx
    return {
        "roots": [s._is_root for s in states],
        "all states are these, root first": [any(a is b for b in states) for a in ctx.all_states] == [True] * 3
        and ctx.all_states[0] is states[0],
        "module fqns": [s._fsdp_param_group._module_fqn for s in states],
        "param fqns": [[p._param_fqn for p in s._fsdp_param_group.fsdp_params] for s in states],
        "modules to run, before and after a step": (before, _train(model) and [set(s._modules_to_run_forward)
                                                                          for s in states]),
        "one comm context": states[1]._comm_ctx is states[0]._comm_ctx,
    }


def _child_lazy_init_first(impl: str) -> tuple[str, str]:
    fully_shard = _fully_shard(impl)
    model = _sharded_model(impl)
    fully_shard.state(model[0])._lazy_init()
    try:
        fully_shard.state(model)._lazy_init()
    except RuntimeError as error:
        return "RuntimeError", str(error)
    return "no error", ""


def _lazy_init_both() -> dict[str, dict]:
    return {impl: {"names": _lazy_init_as_frameworks_see_it(impl), "child first": _child_lazy_init_first(impl)}
            for impl in ("torch", "shardkit")}


def test_lazy_init_through_fully_shard_state_sets_what_torch_sets():
    for result in run_on_ranks(2, _lazy_init_both):
        theirs, ours = result["torch"]["names"], result["shardkit"]["names"]
        assert ours == theirs
        assert ours["roots"] == [True, False, False]
        assert ours["module fqns"] == ["", "0", "2"]
        assert ours["param fqns"] == [["4.weight", "4.bias"], ["0.weight", "0.bias"], ["2.weight", "2.bias"]]
        assert ours["modules to run, before and after a step"] == ([set()] * 3, [set()] * 3)
        (_, torch_message), (kind, our_message) = result["torch"]["child first"], result["shardkit"]["child first"]
        assert kind == "RuntimeError"
        assert torch_message.startswith("FSDP state has already been lazily initialized for 0\n"
                                        "FSDP requires running forward through the root module first")
        assert our_message.startswith(torch_message)


def _cast_to_float64_with_swapped_tensors(impl: str) -> list[torch.Tensor]:
    fully_shard, mesh = _fully_shard(impl), _mesh((2,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 5))
    originals = list(model.parameters())  # the caller still holds the parameters it built (as after a loop over them)
    for module in _sharded_modules(model):
        fully_shard(module, mesh=mesh)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert all(p.dtype == p.to_local().dtype == torch.float64 for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        torch.manual_seed(100 + step + dist.get_rank())
        model(torch.randn(4, 8, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    del originals
    return [p.full_tensor().detach() for p in model.parameters()]


def _cast_both() -> dict[str, list[torch.Tensor]]:
    return {impl: _cast_to_float64_with_swapped_tensors(impl) for impl in ("torch", "shardkit")}


def test_casting_a_sharded_model_with_swapped_tensors_trains_as_torch():
    """``module.to(dtype)`` swaps the parameter tensors in place when
    ``torch.__future__.set_swap_module_params_on_conversion(True)``; a swap
    refuses tensors that anything holds a weak reference to."""
    for result in run_on_ranks(2, _cast_both):
        assert len(result["shardkit"]) == len(result["torch"]) == 6
        assert all(torch.equal(a, b) for a, b in zip(result["shardkit"], result["torch"]))


def _unshard_returns(impl: str) -> tuple[object, bool]:
    model = _sharded_model(impl)
    synchronous = model.unshard()
    model.reshard()
    handle = model.unshard(async_op=True)
    handle.wait()
    model.reshard()
    return synchronous, callable(getattr(handle, "wait", None))


def test_unshard_returns_none_unless_asked_for_a_handle_as_torch():
    for result in run_on_ranks(2, _unshard_both):
        assert result["shardkit"] == result["torch"] == (None, True)


def _unshard_both() -> dict[str, tuple[object, bool]]:
    return {impl: _unshard_returns(impl) for impl in ("torch", "shardkit")}


def _trained_with_torchs_policies(impl: str) -> list[torch.Tensor]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    fully_shard, mesh = _fully_shard(impl), _mesh((2,))
    policies = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64),
                "offload_policy": CPUOffloadPolicy(pin_memory=False)}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 5))
    for module in _sharded_modules(model):
        fully_shard(module, mesh=mesh, **policies)
    return list(_train(model).values())  # the last step's gradients, then the parameters after it


def _policies_both() -> dict[str, list[torch.Tensor]]:
    return {impl: _trained_with_torchs_policies(impl) for impl in ("torch", "shardkit")}


def test_torchs_own_policy_objects_are_taken_and_train_as_torch():
    """Code written for torch passes torch's MixedPrecisionPolicy / CPUOffloadPolicy
    objects; only its ``fully_shard`` import is swapped."""
    for result in run_on_ranks(2, _policies_both):
        assert len(result["shardkit"]) == len(result["torch"]) == 12
        assert all(torch.equal(a, b) for a, b in zip(result["shardkit"], result["torch"]))
