"""shardkit's sharding core: fully sharded data parallelism on DTensor.

``fully_shard(module)`` shards each parameter on dim 0 across a device mesh
(a ``DTensor`` per parameter), all-gathers a module's parameters just before
its forward and backward, frees them after, and reduce-scatters gradients.
Modules map onto files as follows:

==================  ============================================================
``fully_shard``     the entry point: checks, which modules and parameters a call manages; ``param_groups_of``
``policies``        ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``
``mesh_info``       shard/replicate groups of a 1-D or 2-D mesh; default mesh
``sharded_param``   one parameter: padding, sharded DTensor, unsharded view
``shard_layout``    where a parameter's rows go: shardable or not, padding arithmetic
``param_group``     one all-gather/reduce-scatter unit and its state machine
``fsdp_module``     the ``FSDPModule`` methods, ``UnshardHandle``, forward methods, ``share_comm_ctx``
``comm_hooks``      custom all-gather/reduce-scatter comms, the all-reduce hook, comm settings
``torch_names``     torch's FSDP state attribute names, for frameworks that read them
``module_state``    forward/backward hooks, root detection, end-of-backward callback
``gather_scatter``  copy-in/out, reduce-scatter with SUM-then-divide
``device_sync``     CUDA streams and events, or the inline CPU path
``tensor_parallel`` 2-D: composing FSDP's shard with a parameter's TP placements
``spmd_mesh``       ``dp_mesh_dims``, ``DataParallelMeshDims``: parameters that are DTensors on the full SPMD mesh
``placement_fn``    ``shard_placement_fn`` results: ``Shard``, ``Replicate()``, a per-parameter mesh
``replicate``       ``replicate()``: DDP semantics on the same machinery
``grad_norm``       ``clip_grad_norm_`` over any mix of meshes and placements
``compile``         ``torch.compile``: hooks run eagerly, state-dict keys stay eager
``debug``           ``set_debug``: cross-rank collective checks, named failures
``memory``          ``memory_report``: per-group bytes and what is unsharded now
==================  ============================================================
"""

from shardkit.runtime.debug import set_debug
from shardkit.runtime.fsdp_module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from shardkit.runtime.fully_shard import fully_shard, param_groups_of, sharded_params_of
from shardkit.runtime.grad_norm import clip_grad_norm_
from shardkit.runtime.memory import GroupMemory, MemoryReport, memory_report
from shardkit.runtime.placement_fn import ShardPlacementResult
from shardkit.runtime.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from shardkit.runtime.replicate import ReplicateModule, replicate
from shardkit.runtime.spmd_mesh import DataParallelMeshDims

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "replicate",
    "ReplicateModule",
    "DataParallelMeshDims",
    "ShardPlacementResult",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "share_comm_ctx",
    "clip_grad_norm_",
    "set_debug",
    "memory_report",
    "MemoryReport",
    "GroupMemory",
    "param_groups_of",
    "sharded_params_of",
]
