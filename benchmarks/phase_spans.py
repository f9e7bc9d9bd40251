"""Span timers for the benchmarks that break a call into its phases (``fixed_costs.py``, ``load_phases.py``).

A function or method is wrapped in place: each call adds 1 and its seconds under a label, from any thread.
Nested spans are counted in both, so a report says which labels are parts of others.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Any


class Spans:
    """Calls and seconds per label, since the last :meth:`clear`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Replace ``owner.name`` by the same callable timed under ``label``."""
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                with self._lock:
                    entry = self._taken[label]
                    entry[0] += 1
                    entry[1] += took
        setattr(owner, name, timed)

    def clear(self) -> None:
        with self._lock:
            self._taken.clear()

    def taken(self) -> dict[str, tuple[int, float]]:
        """``{label: (calls, seconds)}`` so far."""
        with self._lock:
            return {label: (int(n), s) for label, (n, s) in self._taken.items()}

    def seconds(self) -> dict[str, float]:
        """``{label: seconds}`` so far."""
        return {label: s for label, (_, s) in self.taken().items()}
