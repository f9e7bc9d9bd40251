"""Misuse of ``fully_shard`` fails early with a ``ShardkitError`` that names
what is wrong and what to do, never with a hang or an internal assertion."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from shardkit import MixedPrecisionPolicy
from shardkit.errors import ConfigurationError
from tests.support.dist import run_on_ranks
from tests.support.models import MLPStack, TiedLinears, WithScalarParameter


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever came out
        from shardkit.errors import ShardkitError

        return {"type": type(exc).__name__, "shardkit": isinstance(exc, ShardkitError), "message": str(exc)}
    return None


def _misuses():
    from shardkit import fully_shard

    def twice():
        model = MLPStack()
        fully_shard(model)
        fully_shard(model)

    def three_d_mesh():
        fully_shard(MLPStack(), mesh=init_device_mesh("cpu", (1, 1, 2)))

    untouched = nn.Linear(7, 4)

    def uneven_dim1():
        fully_shard(untouched, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)

    def placement_not_shard():
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: "dim 0")

    def scalar():
        fully_shard(WithScalarParameter())

    def module_list():
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]))

    def meta_forward():
        with torch.device("meta"):
            model = MLPStack()
        fully_shard(model)
        model(torch.randn(2, 5))

    def reshard_int_not_dividing():
        fully_shard(MLPStack(), reshard_after_forward=3)

    def shared_between_groups():
        model = TiedLinears()
        fully_shard(model.b)
        fully_shard(model)
        model(torch.randn(2, 4))

    def deepcopy_sharded():
        copy.deepcopy(fully_shard(MLPStack()))

    def child_ran_first():
        model = MLPStack()
        fully_shard(model.l0)
        fully_shard(model)
        model.l0(torch.randn(2, 5))
        model(torch.randn(2, 5))

    def bad_policy_type():
        fully_shard(MLPStack(), mp_policy={"param_dtype": torch.bfloat16})

    cases = {name: fn for name, fn in locals().items() if callable(fn) and name not in ("fully_shard", "untouched")}
    errors = {name: _error(fn) for name, fn in cases.items()}
    # a failed fully_shard leaves the module as it was
    errors["failed_call_left_plain_params"] = not any(isinstance(p, DTensor) for p in untouched.parameters())
    errors["failed_call_left_class"] = type(untouched) is nn.Linear
    return errors


EXPECTED = {
    "twice": ("ShardedTwiceError", "Apply fully_shard once per module"),
    "three_d_mesh": ("UnsupportedMeshError", "3-D mesh"),
    "uneven_dim1": ("UnsupportedParameterLayoutError", "7 is not divisible by 2"),
    "placement_not_shard": ("ConfigurationError", "return None, Shard(dim), Replicate() or ShardPlacementResult"),
    "scalar": ("UnshardableParameterError", "scale"),
    "module_list": ("ConfigurationError", "ModuleList"),
    "meta_forward": ("TrainingStateError", "to_empty"),
    "reshard_int_not_dividing": ("ConfigurationError", "must divide the shard group size 2"),
    "shared_between_groups": ("UnshardableParameterError", "fully_shard([module_a, module_b])"),
    "deepcopy_sharded": ("DeepcopyUnsupportedError", "copy the model before fully_shard"),
    "child_ran_first": ("TrainingStateError", "already ran forward as a root"),
    "bad_policy_type": ("ConfigurationError", "MixedPrecisionPolicy"),
}


def test_misuse_raises_shardkit_errors_with_actionable_messages():
    results = run_on_ranks(2, _misuses)
    for rank, errors in enumerate(results):
        assert errors.pop("failed_call_left_plain_params") and errors.pop("failed_call_left_class")
        assert set(errors) == set(EXPECTED)
        for name, (error_type, fragment) in EXPECTED.items():
            got = errors[name]
            assert got is not None, f"{name} did not raise on rank {rank}"
            assert got["shardkit"] and got["type"] == error_type, (name, got)
            assert fragment in got["message"], (name, got["message"])


def test_policy_values_are_checked_where_they_are_built():
    with pytest.raises(ConfigurationError, match="floating-point"):
        MixedPrecisionPolicy(param_dtype=torch.int32)
    with pytest.raises(ConfigurationError, match="torch.dtype"):
        MixedPrecisionPolicy(reduce_dtype="bf16")
    with pytest.raises(ValueError):  # ConfigurationError is also a ValueError
        MixedPrecisionPolicy(cast_forward_inputs="yes")
