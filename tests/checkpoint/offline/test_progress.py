"""Progress on a terminal: redrawn in place, and a failed job's line is closed before the error."""

from __future__ import annotations

import io

from shardkit.checkpoint.offline.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_left_open_by_a_failure_is_closed_once():
    stream = _Tty()
    progress = Progress(stream=stream, interval=0)
    progress.start("reshard", 100)
    progress.update(10)
    assert stream.getvalue().startswith("\r\033[Kreshard") and not stream.getvalue().endswith("\n")
    progress.close()
    progress.close()
    assert stream.getvalue().endswith("\n") and stream.getvalue().count("\n") == 1


def test_a_finished_line_is_not_closed_twice():
    stream = _Tty()
    progress = Progress(stream=stream, interval=0)
    progress.start("convert", 10)
    progress.update(10)
    progress.finish()
    progress.close()
    assert stream.getvalue().count("\n") == 1 and "done in" in stream.getvalue()
