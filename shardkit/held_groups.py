"""Process groups shardkit keeps hold of are let go before the interpreter finalizes.

Why: a gloo group runs worker threads, and one of them sometimes frees a
finished collective's work itself (when it lets go of the work after the
caller did).  Freeing the work frees Python objects with it -- the wrappers of
the collective's tensors -- and that takes the GIL.  If the worker asks for the
GIL while the interpreter is finalizing, CPython (before 3.14) ends the thread
with ``pthread_exit``, whose unwinding through the ``noexcept`` C++ destructor
calls ``std::terminate``: the process dies with SIGABRT, printing
``terminate called without an active exception``, after the program itself
finished.  Only a group still alive at that moment has such threads, and
``destroy_process_group()`` frees a group only when nothing references it
any more.  A late free is likelier on a busy machine (the worker is
preempted right after the collective), and ``async_save``'s own group carries
the last tensor collectives of a run (the commit of its last save).

So shardkit never keeps a group alive on its own account into finalization:

* a cache kept per process group remembers the group weakly (:class:`GroupRef`);
* what must hold a group (``async_save``'s group, the runtime's meshes and
  subgroups) registers a release with :func:`release_at_exit`.  The releases
  run in an exit function -- after the program's threads were joined, before
  finalization -- so each group whose last reference they drop is destroyed
  there, while its worker threads can still take the GIL.

Groups that something else still holds (the program itself, or torch's own
caches once DTensors were used) are out of shardkit's reach; docs/api.md says
how a program avoids the same abort with them.

A script whose model and ``CheckpointManager`` are module globals (no
``main()``) may end while a background save is still running.  The
interpreter's exit then stops ``concurrent.futures`` from starting work
("cannot schedule new futures after interpreter shutdown") before the atexit
functions run: the save fails, the step is lost although every rank exits 0,
and the failure's traceback -- kept by the module-level manager -- holds the
save's process group alive into finalization, which is the abort above.  So
what must finish before the interpreter stops thread pools registers with
:func:`finish_before_exit`; those functions run first in the interpreter's
exit, before ``threading`` joins the program's threads and before
``concurrent.futures`` refuses new work.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its pools' exit hook first, so finish_before_exit runs before it
import logging
import threading
import weakref
from typing import Any, Callable

__all__ = ["GroupRef", "finish_before_exit", "release_at_exit"]

log = logging.getLogger(__name__)

_releases: list[Callable[[], None]] = []
_finishers: list[Callable[[], None]] = []
_lock = threading.Lock()


class GroupRef:
    """A process group (or ``None``, the default group) remembered by identity without keeping it alive."""

    __slots__ = ("_ref",)

    def __init__(self, group: Any) -> None:
        self._ref = None if group is None else weakref.ref(group)

    def refers_to(self, group: Any) -> bool:
        """Whether ``group`` is the group this was made from (never true once that group is gone)."""
        return group is None if self._ref is None else self._ref() is group


def release_at_exit(release: Callable[[], None]) -> None:
    """Call ``release`` -- which drops references to process groups -- when the interpreter exits, before
    it finalizes (releases registered later run first, like exit functions)."""
    with _lock:
        _releases.append(release)


def _release_all() -> None:
    """Run every registered release.  An exit function registered at import: it runs after the exit
    functions registered later (the program's own, which may still save), after ``threading`` joined the
    program's threads, and before the interpreter finalizes."""
    with _lock:
        releases = list(reversed(_releases))
    for release in releases:
        try:
            release()
        except Exception:  # noqa: BLE001 - one failing release must not keep the others' groups alive
            log.debug("releasing process groups at exit failed in %r", release, exc_info=True)


def finish_before_exit(finish: Callable[[], None]) -> None:
    """Call ``finish`` -- which waits for shardkit's own background work, such as a save in flight -- when
    the main thread leaves the program, before ``threading`` joins the other threads and before
    ``concurrent.futures`` stops taking work (functions registered later run first).  An exception it
    raises is logged, not raised: the program has ended, and the work reports its failure itself."""
    with _lock:
        _finishers.append(finish)


def _finish_all() -> None:
    with _lock:
        finishers = list(reversed(_finishers))
    for finish in finishers:
        try:
            finish()
        except Exception:  # noqa: BLE001 - one failing finisher must not keep the others from running
            log.warning("finishing shardkit's background work at exit failed in %r", finish, exc_info=True)


atexit.register(_release_all)
# threading's own exit hooks run, last registered first, before the program's threads are joined and
# before atexit; concurrent.futures (imported above) registered its pools' shutdown earlier, so this runs
# before it.  (A CPython function without a public name; it exists since 3.9.)
threading._register_atexit(_finish_all)
