"""``ShardkitStrategy``: Lightning's ``ModelParallelStrategy`` with shardkit as the checkpoint engine.

Why a strategy and not a ``CheckpointIO`` plugin: Lightning's sharded
strategies call torch DCP themselves and refuse ``storage_options``
(``ModelParallelStrategy.save_checkpoint`` raises ``TypeError``), so the only
seam a sharded checkpoint has is the strategy.  Everything else is the base
class's: the process group, the ``("data_parallel", "tensor_parallel")``
device mesh the user's ``configure_model`` reads as ``self.device_mesh``, the
materialisation of meta-device modules, the launcher.  The user shards with
``shardkit.fully_shard`` there (torch's ``fully_shard`` works too: the
checkpoint code reads only DTensor placements).

What changes is what a checkpoint is (:mod:`.store`): the state dicts are the
live sharded tensors (no gather, no copy to the CPU), saved and loaded
through ``shardkit.checkpoint`` at any fsspec URL, optionally in the
background and through a ``CheckpointManager`` (``keep_last``, ``dedup``, the
``local=`` hot tier); loading works at any world size and also reads the DCP
folders Lightning's own ``ModelParallelStrategy`` wrote.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Literal, Mapping

import torch

import shardkit.checkpoint as skc
from shardkit.integrations.lightning.sizes import mesh_sizes
from shardkit.integrations.lightning.state import optimizer_key, split_checkpoint
from shardkit.integrations.lightning.store import CheckpointStore
from shardkit.integrations.requirements import import_framework

strategies = import_framework("lightning.pytorch.strategies", "lightning")
core_optimizer = import_framework("lightning.pytorch.core.optimizer", "lightning")

__all__ = ["ShardkitStrategy"]

log = logging.getLogger(__name__)

DEFAULT_PG_TIMEOUT = timedelta(minutes=30)  # torch's default, as Lightning's strategies use


class ShardkitStrategy(strategies.ModelParallelStrategy):
    """``Trainer(strategy=ShardkitStrategy(...))``: shard in ``configure_model`` with ``shardkit.fully_shard``
    on ``self.device_mesh["data_parallel"]``; checkpoints go through shardkit.

    ``data_parallel_size="auto"``: every rank not used for tensor parallelism
    (plain FSDP over the world by default: ``tensor_parallel_size=1``).

    Checkpoint options: ``async_save`` (the save returns once the state is on
    the host), ``compression``, ``storage_options`` (fsspec options for every
    path, merged with those ``trainer.save_checkpoint`` is given); and, which
    make the checkpoints managed steps (see :mod:`.store`): ``keep_last``,
    ``dedup``, ``local`` with ``replicas``, ``local_world_size``,
    ``local_keep``, ``durable_every`` -- :class:`~shardkit.checkpoint.CheckpointManager`'s options.
    """

    def __init__(self, data_parallel_size: Literal["auto"] | int = "auto",
                 tensor_parallel_size: Literal["auto"] | int = 1, *, async_save: bool = False,
                 keep_last: int | None = None, dedup: bool | str = False, local: str | None = None,
                 compression: Any = None, storage_options: Mapping[str, Any] | None = None,
                 process_group_backend: str | None = None, timeout: timedelta | None = DEFAULT_PG_TIMEOUT,
                 **hot_tier: Any) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         timeout=timeout)
        self.store = CheckpointStore(async_save=async_save, keep_last=keep_last, dedup=dedup, local=local,
                                     compression=compression, storage_options=storage_options, **hot_tier)
        self.store.agree = self.broadcast

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = mesh_sizes(
            self._data_parallel_size, self._tensor_parallel_size, self.num_nodes * self.num_processes)
        self.store.set_ranks_per_node(self.num_processes)
        super().setup_environment()

    # -- the state dicts Lightning asks for: live and sharded, never gathered --
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return skc.get_training_state(self.model)["model"]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, core_optimizer.LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        return skc.get_training_state(self.model, optimizer)["optim"]

    def _plain_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o.optimizer if isinstance(o, core_optimizer.LightningOptimizer) else o for o in self.optimizers]

    # -- checkpoints -------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Save Lightning's ``checkpoint`` dict at ``filepath`` (any fsspec URL) through shardkit; collective."""
        url = self.broadcast(os.fspath(filepath))
        tensors, rest = split_checkpoint(checkpoint)
        assert self.model is not None
        self.store.save(url, tensors, rest, step=int(rest.get("global_step", 0)), model=self.model,
                        optimizers=self._plain_optimizers(), storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Load into the set-up model and optimizers in place (any world size); return the loop's state."""
        url = self.broadcast(os.fspath(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        optimizers = {optimizer_key(i): o for i, o in enumerate(self._plain_optimizers())}
        return self.store.load(url, self.model, optimizers, strict=self.lightning_module.strict_loading)

    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        """``ModelCheckpoint``'s top-k and ``last`` removal: the checkpoint (or pointer) at ``filepath``."""
        self.store.remove(os.fspath(filepath))

    def teardown(self) -> None:
        self.store.wait()  # a background save commits before the run is over
        super().teardown()
