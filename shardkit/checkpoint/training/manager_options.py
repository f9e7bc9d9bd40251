"""What a :class:`~shardkit.checkpoint.training.manager.CheckpointManager` is configured with, checked once:
:class:`ManagerOptions`, and :class:`HotOptions` for its node-local tier (``local=``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping

from shardkit.checkpoint.io.deadline import resolve_timeout
from shardkit.checkpoint.io.retries import with_retries
from shardkit.checkpoint.training.dedup import digest_algorithm
from shardkit.errors import ConfigurationError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ManagerOptions", "HotOptions"]


@dataclass(frozen=True)
class HotOptions:
    """The node-local tier: its directory template, ranks per node, replicas on other nodes, steps kept per
    node, and how often a step goes to the durable root as well."""

    local: str
    local_world_size: int | None = None
    replicas: int = 1
    local_keep: int = 2
    durable_every: int = 1


@dataclass(frozen=True)
class ManagerOptions:
    """A manager's options as its constructor documents them (``save_options``: the other keywords, passed to
    every durable save); ``hot`` is ``None`` without ``local=``."""

    keep_last: int | None = None
    async_save: bool = False
    dedup: str | None = None          # the digest algorithm, or None
    overwrite: bool = False
    compression: Any = None           # as save() takes it: None, "zstd" or "zstd:LEVEL"
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    process_group: ProcessGroup | None = None
    writer: str | None = None
    timeout: float | None = None      # resolved: SHARDKIT_CHECKPOINT_TIMEOUT, else 600 s when not given
    save_options: Mapping[str, Any] = field(default_factory=dict)
    hot: HotOptions | None = None

    @classmethod
    def checked(cls, *, keep_last: int | None, async_save: bool, dedup: bool | str, overwrite: bool,
                compression: Any, storage_options: Mapping[str, Any] | None, process_group: ProcessGroup | None,
                writer: str | None, local: str | None, local_world_size: int | None, replicas: int,
                local_keep: int, durable_every: int, timeout: float | timedelta | None, retries: int | None,
                save_options: Mapping[str, Any]) -> "ManagerOptions":
        """The constructor's arguments, each refused with a message naming it before anything is touched."""
        if not isinstance(durable_every, int) or isinstance(durable_every, bool) or durable_every < 1:
            raise ConfigurationError(f"durable_every must be a positive integer, got {durable_every!r}")
        if local is None and (local_world_size, replicas, local_keep, durable_every) != (None, 1, 2, 1):
            raise ConfigurationError("local_world_size, replicas, local_keep and durable_every configure the "
                                     "node-local tier: pass local= (a directory path, e.g. '/dev/shm/run/node{node}')")
        resolved = resolve_timeout(timeout)
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigurationError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        if writer is not None and not async_save:
            raise ConfigurationError(f"writer={writer!r} chooses how background saves are written; pass "
                                     f"async_save=True with it")
        hot = None if local is None else HotOptions(local, local_world_size, replicas, local_keep, durable_every)
        return cls(keep_last, async_save, digest_algorithm(dedup) if dedup else None, bool(overwrite), compression,
                   with_retries(storage_options, retries) or {}, process_group, writer, resolved, dict(save_options),
                   hot)
