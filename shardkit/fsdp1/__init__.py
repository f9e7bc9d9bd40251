"""The FSDP1 surface (``torch.distributed.fsdp``'s names) on the shardkit core.

Migrating an FSDP1 script is an import change::

    from shardkit import FullyShardedDataParallel as FSDP, ShardingStrategy, MixedPrecision
    from shardkit.wrap import transformer_auto_wrap_policy

``docs/migration.md`` maps every FSDP1 argument and method onto the core.
"""

from shardkit.fsdp1.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from shardkit.fsdp1.wrapper import FullyShardedDataParallel

__all__ = [
    "FullyShardedDataParallel",
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]
