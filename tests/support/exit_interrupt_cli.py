"""The ``shardkit`` console script, with every data file after the first stuck for a while in its worker.

    python tests/support/exit_interrupt_cli.py STUCK_S reshard SRC DST ...

Why: to interrupt a ``reshard``/``convert`` while its workers are inside
requests that a signal cannot cut short (a slow object-store PUT, a retry's
wait), deterministically.  The first data file is written at once (so its
journal entry appears and the test knows the command is writing); every later
``NativeWriter.write_file`` first sleeps ``STUCK_S`` seconds on its worker
thread, as a request that does not answer would.  Then it runs
:func:`shardkit.cli.main.main` exactly as the ``shardkit`` command does.
"""

from __future__ import annotations

import sys
import threading
import time

from shardkit.checkpoint.formats.native.writer import NativeWriter
from shardkit.cli.main import main


def stick_writes_after_the_first(stuck_s: float) -> None:
    write_file, lock, calls = NativeWriter.write_file, threading.Lock(), [0]

    def stuck(self, *args, **kwargs):
        with lock:
            calls[0] += 1
            first = calls[0] == 1
        if not first:
            time.sleep(stuck_s)
        return write_file(self, *args, **kwargs)

    NativeWriter.write_file = stuck


if __name__ == "__main__":
    stick_writes_after_the_first(float(sys.argv[1]))
    sys.argv = ["shardkit", *sys.argv[2:]]
    main()
