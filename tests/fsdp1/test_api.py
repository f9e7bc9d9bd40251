"""The FSDP1 vocabulary mirrors ``torch.distributed.fsdp``: same names, members,
fields and defaults, so that migrating a script is an import change."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.fully_sharded_data_parallel as torch_fsdp_impl

import shardkit
import shardkit.fsdp1 as sk_fsdp

ENUMS = ["ShardingStrategy", "BackwardPrefetch", "StateDictType", "OptimStateKeyType"]
CONFIGS = ["MixedPrecision", "CPUOffload", "StateDictConfig", "FullStateDictConfig",
           "LocalStateDictConfig", "ShardedStateDictConfig", "OptimStateDictConfig",
           "FullOptimStateDictConfig", "LocalOptimStateDictConfig", "ShardedOptimStateDictConfig",
           "StateDictSettings"]


def _torch(name):
    return getattr(torch_fsdp, name, None) or getattr(torch_fsdp_impl, name)


@pytest.mark.parametrize("name", ENUMS)
def test_enum_members_match_torch(name):
    assert [m.name for m in getattr(sk_fsdp, name)] == [m.name for m in _torch(name)]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_fields_and_defaults_match_torch(name):
    def fields(cls):
        return [(f.name, f.default) for f in dataclasses.fields(cls)]

    assert fields(getattr(sk_fsdp, name)) == fields(_torch(name))


@pytest.mark.parametrize("name", ENUMS + CONFIGS)
def test_names_import_from_the_top_level_package(name):
    assert getattr(shardkit, name) is getattr(sk_fsdp, name)


def test_wrap_module_exports_fsdp1_policy_names():
    ours = importlib.import_module("shardkit.wrap")
    for name in ("transformer_auto_wrap_policy", "size_based_auto_wrap_policy", "ModuleWrapPolicy",
                 "lambda_auto_wrap_policy", "CustomPolicy", "always_wrap_policy", "enable_wrap", "wrap",
                 "_or_policy"):
        assert callable(getattr(ours, name)), name
