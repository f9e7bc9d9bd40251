"""Progress of a long offline job: bytes done, rate and ETA, reported on stderr.

The library never prints on its own; callers pass a :class:`Progress` (the
CLI does, ``--quiet`` does not).  Updates come from several worker threads,
so counting is locked and rendering is throttled to a few lines per second.
On a terminal the line is redrawn in place; in a log it is appended at most
every few seconds, so CI logs stay readable.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress", "human_bytes", "human_seconds", "human_count"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"  # pragma: no cover


def human_count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun agreeing with it: ``1 rank``, ``0 ranks``, ``2 ranks`` (``plural`` for the
    nouns that do not just take an ``s``: ``human_count(2, "value differs", "values differ")``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def human_seconds(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """Counts bytes towards a total and renders ``label  done/total  rate  ETA``."""

    def __init__(self, label: str = "", total: int = 0, stream: TextIO | None = None,
                 interval: float | None = None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.skipped = 0
        self.stream = stream if stream is not None else sys.stderr
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.2 if self._tty else 5.0)
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last = 0.0
        self._open = False  # a terminal line drawn without its newline yet

    def start(self, label: str, total: int) -> None:
        with self._lock:
            self.label, self.total, self.done, self.skipped = label, total, 0, 0
            self._start = time.monotonic()
            self._last = 0.0

    def skip(self, n: int) -> None:
        """Bytes already present (a resumed run): counted as done, not in the rate."""
        with self._lock:
            self.done += n
            self.skipped += n

    def update(self, n: int) -> None:
        """Count ``n`` bytes moved; redraw the line at most every ``interval`` seconds."""
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last < self.interval:
                return
            self._last = now
            line = self._line(now)
        self._emit(line, final=False)

    def _line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-6)
        moved = self.done - self.skipped
        rate = moved / elapsed
        pct = f"{100 * self.done / self.total:5.1f}%" if self.total else "  ?  "
        eta = human_seconds((self.total - self.done) / rate) if rate > 0 and self.total else "?"
        return (f"{self.label} {pct}  {human_bytes(self.done)}/{human_bytes(self.total)}  "
                f"{human_bytes(rate)}/s  ETA {eta}")

    def _emit(self, line: str, final: bool) -> None:
        try:
            if self._tty:
                self._open = not final
                self.stream.write("\r\033[K" + line + ("\n" if final else ""))
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed stderr must not fail the job
            pass

    def close(self) -> None:
        """End a line left open on a terminal (a failed job), so the error message starts on its own line."""
        with self._lock:
            was_open, self._open = self._open, False
        if was_open:
            try:
                self.stream.write("\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def finish(self) -> None:
        with self._lock:
            now = time.monotonic()
            line = self._line(now) + f"  done in {human_seconds(now - self._start)}"
        self._emit(line, final=True)

    def note(self, message: str) -> None:
        """A one-line message for the user (stderr), e.g. a skipped key."""
        self._emit(message, final=True)
