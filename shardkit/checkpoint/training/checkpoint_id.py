"""Where a checkpoint call points: shardkit's ``url`` argument or DCP's ``checkpoint_id=``.

``torch.distributed.checkpoint.save/load/async_save`` take the location as the
keyword ``checkpoint_id`` (a path or URL); shardkit's take it as the second
argument ``url``.  Both are accepted, so DCP calls run with the import
swapped, and giving the location twice -- or not at all -- is one clear error
rather than a guess at which was meant.
"""

from __future__ import annotations

import os
from typing import Any

from shardkit.errors import ConfigurationError

__all__ = ["checkpoint_url"]


def checkpoint_url(url: Any, checkpoint_id: Any, call: str) -> str:
    """The one location given to ``call`` (``url`` or ``checkpoint_id``, a str or ``os.PathLike``)."""
    if url is not None and checkpoint_id is not None:
        raise ConfigurationError(f"{call}() got both url={url!r} and checkpoint_id={checkpoint_id!r}; pass the "
                                 "checkpoint's location once (checkpoint_id= is DCP's name for url)")
    where = url if url is not None else checkpoint_id
    if where is None:
        raise ConfigurationError(f"{call}() needs the checkpoint's location: pass url (or DCP's checkpoint_id=), "
                                 "e.g. './ckpt/step-100' or 's3://bucket/run/step-100'")
    if not isinstance(where, (str, os.PathLike)):
        raise ConfigurationError(f"{call}(): the checkpoint's location must be a path or URL string, got "
                                 f"{type(where).__name__}")
    return os.fspath(where)
