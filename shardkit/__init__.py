"""shardkit: fully sharded data parallelism on DTensor, and checkpoints that
reshard, convert and migrate anywhere fsspec reaches.

The public surface is re-exported here::

    from shardkit import fully_shard, MixedPrecisionPolicy      # the sharding core
    from shardkit import clip_grad_norm_, memory_report, set_debug  # its tools
    from shardkit import FullyShardedDataParallel, ShardingStrategy  # FSDP1 surface
    from shardkit.wrap import transformer_auto_wrap_policy       # FSDP1 wrap policies
    import shardkit.checkpoint as skc                             # save / load / convert
    from shardkit.data import ElasticSampler, ElasticLoader       # resumable input state

Names resolve lazily so that ``import shardkit`` stays cheap and the
checkpoint half never pulls in the runtime (DESIGN: data flows one way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardkit.lazy import lazy_exports

__version__ = "0.1.0"

_RUNTIME = "shardkit.runtime"
_FSDP1 = "shardkit.fsdp1"

_EXPORTS: dict[str, str] = {
    # the sharding core (FSDP2 contract)
    "fully_shard": _RUNTIME,
    "FSDPModule": _RUNTIME,
    "UnshardHandle": _RUNTIME,
    "register_fsdp_forward_method": _RUNTIME,
    "MixedPrecisionPolicy": _RUNTIME,
    "OffloadPolicy": _RUNTIME,
    "CPUOffloadPolicy": _RUNTIME,
    "share_comm_ctx": _RUNTIME,
    "clip_grad_norm_": _RUNTIME,
    "set_debug": _RUNTIME,
    "memory_report": _RUNTIME,
    "replicate": _RUNTIME,
    "ReplicateModule": _RUNTIME,
    "DataParallelMeshDims": _RUNTIME,
    "ShardPlacementResult": _RUNTIME,
    # the FSDP1 surface mapped onto the core
    "FullyShardedDataParallel": _FSDP1,
    "ShardingStrategy": _FSDP1,
    "MixedPrecision": _FSDP1,
    "CPUOffload": _FSDP1,
    "BackwardPrefetch": _FSDP1,
    "StateDictType": _FSDP1,
    "StateDictConfig": _FSDP1,
    "FullStateDictConfig": _FSDP1,
    "ShardedStateDictConfig": _FSDP1,
    "LocalStateDictConfig": _FSDP1,
    "OptimStateDictConfig": _FSDP1,
    "FullOptimStateDictConfig": _FSDP1,
    "ShardedOptimStateDictConfig": _FSDP1,
    "LocalOptimStateDictConfig": _FSDP1,
    "OptimStateKeyType": _FSDP1,
    "StateDictSettings": _FSDP1,
}

_SUBMODULES = {"checkpoint", "data", "errors", "runtime", "fsdp1", "wrap", "cli"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _SUBMODULES)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from shardkit.fsdp1 import *  # noqa: F401,F403
    from shardkit.runtime import *  # noqa: F401,F403
