"""Choosing shardkit from torchtitan's command line: ``--override.imports`` names this module's factory.

torchtitan swaps a component by replacing its config node before anything is
built (``torchtitan.config.override``); the factory below replaces the
``checkpoint`` node (any ``BaseCheckpointManager.Config``, torchtitan's DCP one by
default) with :class:`ShardkitCheckpointManager.Config`, copying every option the
two share (``enable``, ``folder``, ``interval``, ``keep_latest_k``, ``async_mode``,
...)::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports shardkit.integrations.torchtitan.override.shardkit_checkpoint

Options of shardkit's own ride along as JSON:
``'shardkit.integrations.torchtitan.override.shardkit_checkpoint={"compression": "zstd"}'``.
"""

from __future__ import annotations

from typing import Any

from shardkit.integrations.requirements import import_framework
from shardkit.integrations.torchtitan.manager import ShardkitCheckpointManager

_base = import_framework("torchtitan.components.checkpointer.base", "torchtitan")
_override = import_framework("torchtitan.config.override", "torchtitan")

__all__ = ["shardkit_checkpoint"]

TARGET = f"{__name__}.shardkit_checkpoint"  # what --override.imports lists


@_override.override(target=_base.BaseCheckpointManager.Config,
                    description="shardkit as the checkpoint engine (ShardkitCheckpointManager)")
def shardkit_checkpoint(config: Any, **options: Any) -> Any:
    """``config``'s options on :class:`ShardkitCheckpointManager.Config`, plus shardkit's own ``options``."""
    return _override.derive(config, ShardkitCheckpointManager.Config, **options)
