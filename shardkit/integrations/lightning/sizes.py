"""What ``data_parallel_size="auto"`` and ``tensor_parallel_size="auto"`` mean for shardkit's strategies.

Why not Lightning's meaning: its ``ModelParallelStrategy`` reads ``"auto"`` as
tensor parallelism over each node's devices and data parallelism across
nodes, so one node gets no FSDP at all.  shardkit's strategies are first an
FSDP engine: ``"auto"`` tensor parallelism is none (1), and ``"auto"`` data
parallelism is every process left over.
"""

from __future__ import annotations

from typing import Any

from shardkit.errors import ConfigurationError

__all__ = ["mesh_sizes"]


def mesh_sizes(data_parallel_size: Any, tensor_parallel_size: Any, world_size: int) -> tuple[int, int]:
    """``(data_parallel_size, tensor_parallel_size)`` with ``"auto"`` resolved for ``world_size`` processes."""
    tp = 1 if tensor_parallel_size == "auto" else int(tensor_parallel_size)
    if data_parallel_size != "auto":
        return int(data_parallel_size), tp
    if tp < 1 or world_size % tp:
        raise ConfigurationError(f"tensor_parallel_size={tensor_parallel_size} does not divide the {world_size} "
                                 f"processes of this run")
    return world_size // tp, tp
