"""shardkit as the checkpoint engine of torchtitan: :class:`ShardkitCheckpointManager`.

Select it where torchtitan selects a checkpoint backend -- the trainer's
``checkpoint`` config node::

    from shardkit.integrations.torchtitan import ShardkitCheckpointManager
    config.checkpoint = ShardkitCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3)

or from the command line, ``--override.imports
shardkit.integrations.torchtitan.override.shardkit_checkpoint`` (:mod:`.override`).
Importing this package without torchtitan installed raises ``IntegrationUnavailable``
naming ``pip install 'shardkit[torchtitan]'``.
"""

from __future__ import annotations

from shardkit.lazy import lazy_exports

_EXPORTS = {
    "ShardkitCheckpointManager": "shardkit.integrations.torchtitan.manager",
    "shardkit_checkpoint": "shardkit.integrations.torchtitan.override",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
