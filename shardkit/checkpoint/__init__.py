"""shardkit.checkpoint: save, load and reshard training state anywhere fsspec reaches.

In a training job::

    import shardkit.checkpoint as skc

    sd = skc.get_training_state(model, optimizer)  # FQN-keyed, DTensor values for sharded params
    skc.save(sd, "s3://bucket/run/step-100")        # collective; each rank writes its own shards
    ...
    sd = skc.get_training_state(model, optimizer)  # the new job's layout (any world size / mesh)
    skc.load(sd, "s3://bucket/run/step-100")        # in place; each rank reads only its byte ranges
    skc.set_training_state(model, optimizer, sd)

    manager = skc.CheckpointManager("s3://bucket/run", keep_last=3)
    manager.save(step, model, optimizer, extra={"data_pos": 1234})
    resumed = manager.load_latest(model, optimizer)   # (step, extra) or None

Offline (no process group): ``reshard``, ``convert``, ``inspect``, ``verify`` and
``diff`` live in ``shardkit.checkpoint.offline.convert`` and are re-exported here.

Names resolve lazily so ``import shardkit.checkpoint`` stays cheap, and this
package never imports the sharding runtime (data flows one way).
"""

from __future__ import annotations

from shardkit.checkpoint.training.restarts import check_restartable
from shardkit.lazy import lazy_exports

check_restartable()  # a torchrun restart that would hang in init_process_group fails now, naming the fix

_EXPORTS: dict[str, str] = {
    "get_training_state": "shardkit.checkpoint.state.training_state",
    "set_training_state": "shardkit.checkpoint.state.training_state",
    "get_full_state_dict": "shardkit.checkpoint.state.full_state_dict",
    "set_full_state_dict": "shardkit.checkpoint.state.full_state_dict",
    "save": "shardkit.checkpoint.training.save",
    "async_save": "shardkit.checkpoint.training.async_save",
    "load": "shardkit.checkpoint.training.load",
    "CheckpointManager": "shardkit.checkpoint.training.manager",
    "load_pretrained": "shardkit.checkpoint.training.pretrained",
    "Compression": "shardkit.checkpoint.formats.compression",
    "open_reader": "shardkit.checkpoint.formats",
    "reshard": "shardkit.checkpoint.offline.convert",
    "convert": "shardkit.checkpoint.offline.convert",
    "inspect": "shardkit.checkpoint.offline.convert",
    "verify": "shardkit.checkpoint.offline.verify",
    "diff": "shardkit.checkpoint.offline.diff",
}

__all__ = sorted(_EXPORTS)


_lazy_getattr, __dir__ = lazy_exports(__name__, _EXPORTS)


def __getattr__(name: str) -> object:
    if name in ("get_state_dict", "set_state_dict"):
        raise AttributeError(f"shardkit.checkpoint.{name} is now {name.replace('state_dict', 'training_state')} "
                             f"(the {{'model': ..., 'optim': ...}} dict that save/load take); torch's DCP form is "
                             f"shardkit.checkpoint.state_dict.{name}")
    return _lazy_getattr(name)
