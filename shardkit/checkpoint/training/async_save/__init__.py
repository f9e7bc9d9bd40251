"""``async_save``: copy the state to host memory, then write and commit in the background.

The package's modules, one step of an async save each:

* ``saver.py``: :func:`async_save` and the per-process :class:`BackgroundSaver`
  (the blocking copy, then writing and committing off the training thread).
* ``host_buffers.py``: :class:`StagingPool`, the reused (shared) host buffer the
  state is copied into.
* ``repeat_copy.py``: :class:`RepeatStaging`, a repeat save of an unchanged
  structure reduced to a copy.
* ``writer_process.py``: the long-lived writer process and its protocol.

The names are resolved on first use, not at import: ``writer_process`` is run
as ``python -m``, and a package that imported it on the way in would have it
loaded twice.
"""

from __future__ import annotations

from shardkit.lazy import lazy_exports

_EXPORTS = {name: f"{__name__}.saver" for name in ("async_save", "BackgroundSaver", "background_saver", "WRITERS")}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
