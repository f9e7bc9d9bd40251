"""The O_DIRECT staging buffer is a thread's own: a forked process gets a copy, never the same pages."""

from __future__ import annotations

import os

from shardkit.checkpoint.io.direct_io import staging_buffer


def test_a_forked_child_writing_its_stagingstaging_buffer_leaves_the_parents_as_it_was():
    buf = staging_buffer()
    buf[:4] = b"mine"
    pid = os.fork()
    if pid == 0:  # the child stages its own bytes in what it inherited, as a forked rank's save would
        staging_buffer()[:4] = b"kid!"
        os._exit(0)
    os.waitpid(pid, 0)
    assert bytes(buf[:4]) == b"mine"
