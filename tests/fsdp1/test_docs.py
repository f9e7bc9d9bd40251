"""docs/migration.md covers every FSDP1 argument and method, and the surface it
documents exists: same constructor parameters, same methods as torch's FSDP1."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

import shardkit
import shardkit.fsdp1
from shardkit import FullyShardedDataParallel as FSDP

DOC = (Path(__file__).resolve().parents[2] / "docs" / "migration.md").read_text()


def _table_rows(heading: str) -> dict[str, str]:
    """First-column names (backticked) of the table under ``heading``."""
    section = DOC[DOC.index(heading):]
    section = section[:section.index("\n#", 1)] if "\n#" in section[1:] else section
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\|\s*`([A-Za-z_0-9]+)", line)
        if match:
            rows[match.group(1)] = line
    return rows


def _torch_arguments() -> list[str]:
    return list(inspect.signature(TorchFSDP.__init__).parameters)[1:]


def _torch_methods() -> list[str]:
    return sorted(n for n in vars(TorchFSDP) if not n.startswith("_"))


def test_every_fsdp1_constructor_argument_has_a_row():
    rows = _table_rows("### Constructor arguments")
    missing = [a for a in _torch_arguments() if a not in rows]
    assert not missing, f"docs/migration.md lacks constructor arguments {missing}"


def test_every_fsdp1_method_has_a_row():
    rows = _table_rows("### Methods")
    missing = [m for m in _torch_methods() if m not in rows]
    assert not missing, f"docs/migration.md lacks methods {missing}"


def test_constructor_signature_matches_torch():
    ours = inspect.signature(FSDP)
    assert list(ours.parameters) == _torch_arguments()
    theirs = inspect.signature(TorchFSDP.__init__).parameters
    for name, param in ours.parameters.items():
        if name in ("backward_prefetch",):
            assert param.default.name == theirs[name].default.name
        else:
            assert param.default == theirs[name].default, name


def test_every_fsdp1_method_exists_on_shardkits_class():
    missing = [m for m in _torch_methods() if not hasattr(FSDP, m)]
    assert not missing


def test_every_strategy_and_mixed_precision_field_is_documented():
    strategies = _table_rows("### Sharding strategies")
    assert set(strategies) == {s.name for s in shardkit.ShardingStrategy}
    fields = _table_rows("### Mixed precision")
    assert set(fields) == {f for f in shardkit.MixedPrecision.__dataclass_fields__}


def test_documented_imports_exist():
    for name in shardkit.fsdp1.__all__:
        assert name in DOC, name
        assert getattr(shardkit, name) is getattr(shardkit.fsdp1, name)
    for name in ("transformer_auto_wrap_policy", "size_based_auto_wrap_policy", "ModuleWrapPolicy",
                 "lambda_auto_wrap_policy", "CustomPolicy", "apply_fully_shard"):
        assert name in DOC and hasattr(shardkit.wrap, name), name
