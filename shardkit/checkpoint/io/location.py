"""One spelling per place: ``./ckpt``, ``/abs/ckpt/`` and ``file:///abs/ckpt`` are one directory, and
``s3://b/x/``, ``s3://b/x`` and ``s3a://b/x`` one prefix.

Why: anything keyed by where a checkpoint lives -- a resume journal's source, the SRC/DST overlap check,
the hot tier's node-local ``run-<digest>`` directories -- must find the same key however the user
typed the URL this time, or it silently misses what an earlier run left.

:func:`canonical_location` spells an open :class:`~shardkit.checkpoint.io.storage.Storage` (its endpoint
included, so one bucket name on two S3-compatible services is two places); :func:`canonical_url` spells a
URL without opening a filesystem (no credentials asked, no network), for keys made before any storage is.
"""

from __future__ import annotations

import os

from shardkit.checkpoint.io.storage import Storage

__all__ = ["canonical_location", "canonical_url"]


def canonical_location(storage: Storage) -> str:
    """One spelling per place: symlinks and relative paths resolved locally, no trailing slash remotely.

    Remotely the endpoint is part of the place: ``s3://ckpts/run`` on two
    S3-compatible services are two places (a migration between them is fine).
    """
    if storage.paths_are_os_paths:
        return "file://" + os.path.realpath(storage.root)
    protocol = storage.fs.protocol if isinstance(storage.fs.protocol, str) else storage.fs.protocol[0]
    opts = storage.storage_options
    endpoint = (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                or opts.get("project") or "")
    return f"{protocol}://{storage.root.rstrip('/')}" + (f"@{endpoint}" if endpoint else "")


def canonical_url(url: str | os.PathLike) -> str:
    """:func:`canonical_location`'s spelling of ``url`` without storage options (so without an endpoint):
    ``file://`` + the absolute path with links resolved for a local path or ``file://`` URL; else
    fsspec's own protocol name and path (``s3a://`` is ``s3://``), no trailing slash."""
    import fsspec
    from fsspec.core import split_protocol, strip_protocol

    url = os.fspath(url)
    protocol, path = split_protocol(url)
    if protocol in (None, "file", "local"):
        return "file://" + os.path.realpath(os.path.abspath(path))
    try:
        path = strip_protocol(url)
        names = fsspec.get_filesystem_class(protocol).protocol
        names = names if isinstance(names, (tuple, list)) else (names,)
        protocol = names[0] if protocol in names else protocol
    except (ImportError, ValueError):  # a backend not installed here: the URL as fsspec splits it
        pass
    return f"{protocol}://{path.rstrip('/')}"
