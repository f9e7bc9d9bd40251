"""``ShardkitFabricStrategy``: Fabric's ``ModelParallelStrategy`` with shardkit as the checkpoint engine.

Why: ``fabric.save``/``fabric.load`` with Lightning's strategy write torch DCP
to local paths only and refuse ``storage_options``.  Here the model and
optimizers of the ``state`` dict are saved as their live sharded tensors
through ``shardkit.checkpoint`` (any fsspec URL, in the background with
``async_save``), under the keys the user gave them; every other entry (plain
values, objects with ``state_dict()``) is kept as JSON in the manifest
(:mod:`.state`), never pickle.  ``fabric.load`` fills the objects in place at
any world size and returns what ``state`` did not ask for, as Fabric's own
strategies do.  The gradient-sync switch (``fabric.no_backward_sync``) acts
on shardkit's sharded modules as Lightning's acts on torch's.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Callable, Literal, Mapping

import torch
import torch.nn as nn

import shardkit
from shardkit.errors import ConfigurationError, IncompatibleStateDict
from shardkit.integrations.lightning.sizes import mesh_sizes
from shardkit.integrations.lightning.store import CheckpointStore
from shardkit.integrations.requirements import import_framework

fabric_strategies = import_framework("lightning.fabric.strategies", "lightning")

__all__ = ["ShardkitFabricStrategy"]

log = logging.getLogger(__name__)

DEFAULT_PG_TIMEOUT = timedelta(minutes=30)


class _NoSync(AbstractContextManager):
    """Within the block, no sharded module reduces its gradients (they accumulate locally)."""

    def __init__(self, module: nn.Module, enabled: bool) -> None:
        self.module, self.enabled = module, enabled

    def _set(self, requires: bool) -> None:
        for mod in self.module.modules():
            if isinstance(mod, (shardkit.FSDPModule, torch.distributed.fsdp.FSDPModule)):
                mod.set_requires_gradient_sync(requires, recurse=False)

    def __enter__(self) -> None:
        self._set(not self.enabled)

    def __exit__(self, *exc: Any) -> None:
        self._set(self.enabled)


class _BackwardSync:
    """What Fabric's ``no_backward_sync`` asks the strategy for (Lightning's ``_BackwardSyncControl`` interface)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return _NoSync(module, enabled)


class ShardkitFabricStrategy(fabric_strategies.ModelParallelStrategy):
    """``Fabric(strategy=ShardkitFabricStrategy(parallelize_fn))``: ``parallelize_fn(module, device_mesh)``
    shards with ``shardkit.fully_shard``; ``fabric.save``/``fabric.load`` go through shardkit.

    Sizes as :class:`~shardkit.integrations.lightning.ShardkitStrategy` (plain FSDP over the world by default);
    ``async_save``, ``compression`` and ``storage_options`` as there.
    """

    def __init__(self, parallelize_fn: Callable[[nn.Module, Any], nn.Module],
                 data_parallel_size: Literal["auto"] | int = "auto", tensor_parallel_size: Literal["auto"] | int = 1,
                 *, async_save: bool = False, compression: Any = None,
                 storage_options: Mapping[str, Any] | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = DEFAULT_PG_TIMEOUT) -> None:
        super().__init__(parallelize_fn, data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tensor_parallel_size, save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._backward_sync_control = _BackwardSync()
        self.store = CheckpointStore(async_save=async_save, compression=compression, storage_options=storage_options)
        self.store.agree = self.broadcast

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = mesh_sizes(
            self._data_parallel_size, self._tensor_parallel_size, self.num_nodes * self.num_processes)
        super().setup_environment()

    def save_checkpoint(self, path: str | os.PathLike, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Save ``state`` (one sharded model, its optimizers, any other values) at ``path``; collective."""
        if filter is not None:
            raise ConfigurationError(f"saving {path}: fabric.save(filter=...) is not supported with "
                                     f"{type(self).__name__}; save the full state")
        url = self.broadcast(os.fspath(path))
        model_key, model, optimizers = _parts(state, url)
        tensors: dict[str, Any] = {model_key: shardkit.checkpoint.get_training_state(model)["model"]}
        tensors.update({k: shardkit.checkpoint.get_training_state(model, o)["optim"] for k, o in optimizers.items()})
        rest = {k: (v.state_dict() if _stateful(v) else v) for k, v in state.items()
                if k != model_key and k not in optimizers}
        self.store.save(url, tensors, rest, step=0, model=model, optimizers=list(optimizers.values()),
                        storage_options=storage_options)

    def load_checkpoint(self, path: str | os.PathLike, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Fill ``state``'s model, optimizers and objects in place (any world size); return the rest."""
        url = self.broadcast(os.fspath(path))
        if not isinstance(state, dict) or not state:
            raise ConfigurationError(f"loading {url}: pass state={{'model': model, ...}} (a dict holding the "
                                     f"sharded model) to fabric.load with {type(self).__name__}")
        model_key, model, optimizers = _parts(state, url)
        rest = self.store.load(url, model, optimizers, model_key=model_key, strict=strict)
        wanted = [k for k in state if k != model_key and k not in optimizers]
        missing = [k for k in wanted if k not in rest]
        if strict and missing:
            raise IncompatibleStateDict(f"{url} holds no {missing} (asked for in state); pass "
                                        f"strict=False to load without them")
        for key in wanted:
            if key in rest:
                value = rest.pop(key)
                if _stateful(state[key]):
                    state[key].load_state_dict(value)
                else:
                    state[key] = value
        return rest

    def teardown(self) -> None:
        self.store.wait()
        super().teardown()


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)) \
        and not isinstance(obj, (nn.Module, torch.optim.Optimizer))


def _parts(state: Mapping[str, Any], url: str) -> tuple[str, nn.Module, dict[str, torch.optim.Optimizer]]:
    """The key and module of the one sharded model in ``state``, and its optimizers by key."""
    models = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    if len(models) != 1:
        raise ConfigurationError(f"{url}: the state must hold exactly one model (an nn.Module), it holds "
                                 f"{sorted(models) or 'none'}; save several models to several paths")
    (model_key, model), = models.items()
    return model_key, model, {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}


