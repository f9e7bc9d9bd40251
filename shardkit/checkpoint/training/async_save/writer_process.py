"""The writer process of ``async_save``: one long-lived child per training process, both ends of its pipe.

Why a process: checksumming, compression, the file writes of a save and
rank 0's commit compete with the training step for the GIL when they run on
a thread of the training process.  The child does that work; the training
process only copies the state into shared memory
(:mod:`~shardkit.checkpoint.training.async_save.host_buffers`) and, on a
thread, exchanges a few JSON records with the other ranks, which rank 0
passes to its child to commit (:mod:`~shardkit.checkpoint.training.async_save.writer_commit`).

* **Spawned once, reused.**  The child is started on the first save (by the
  background thread, which lives as long as the process) and serves every
  later save; one that died is replaced by the next save.
* **No pickle.**  Requests and replies are JSON lines over its stdin and its
  original stdout (whatever the child would print goes to stderr); the data
  itself never travels, only its place in the shared buffer.
* **Dies with its parent.**  On Linux the child asks the kernel to kill it
  when the training process dies, so a killed job leaves no writer behind
  that could still be writing files.
* **Yields the CPU to training.**  The child runs at a lower priority
  (``WRITER_NICENESS``): where cores are scarce, the training processes get
  them first and the save takes the idle time; with cores to spare it
  changes nothing.
* **Crashes are reported.**  A child that dies mid-save fails that save with a
  :class:`~shardkit.errors.CheckpointError` naming its pid and exit status; the
  save commits nothing, so the previous checkpoint stays as it was.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import WriteChunk
from shardkit.checkpoint.formats.dtypes import code_to_dtype, dtype_to_code
from shardkit.checkpoint.io.concurrency import parallel_map
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.training.async_save.host_buffers import StagingPool
from shardkit.checkpoint.training.async_save.writer_commit import (
    COMMIT_KIND,
    CommitRequest,
    native_writer,
    outcome_from_storage,
    serve_commit,
    writer_fields,
)
from shardkit.checkpoint.training.rank_report import report_from_json
from shardkit.checkpoint.training.save import RelayedFile
from shardkit.checkpoint.training.save_options import SaveOptions
from shardkit.checkpoint.training.save_plan import SavePlan
from shardkit.errors import CheckpointError, ConfigurationError, ShardkitError, error_record, from_record

__all__ = ["WriterProcess", "writer_options", "main"]

log = logging.getLogger(__name__)

WRITER_NICENESS = 10  # added to the writer process's niceness: background work, below the training step

_PR_SET_PDEATHSIG = 1


def writer_options(storage: Storage, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` as the JSON the writer process rebuilds its storage from (refused when not JSON)."""
    try:
        return json.loads(json.dumps(dict(storage_options or {})))
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"async_save(writer='process') to {storage.url}: storage_options must be JSON "
                                 f"(strings, numbers, lists, dicts) to reach the writer process ({exc}); pass "
                                 f"writer='thread' to write from this process") from None


class WriterProcess:
    """The training process's end: start the child, send it a save's files, wait for their records."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._owner = os.getpid()  # a forked copy of this object must not touch the parent's child
        self._lock = threading.Lock()
        self._commits = CommitRequest()
        atexit.register(self.close)

    @property
    def pid(self) -> int | None:
        """The live child's pid (``None`` before the first save or after it died)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def _start(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[3])  # the directory holding the shardkit package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
                   OMP_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-m", __name__, "--parent", str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        log.debug("started the async save writer process, pid %d", proc.pid)
        return proc

    def write_files(self, storage: Storage, storage_options: dict[str, Any],
                    jobs: Sequence[tuple[str, Sequence[WriteChunk]]], pool: StagingPool, *, writer: int,
                    options: SaveOptions) -> list[RelayedFile]:
        """Have the child write each ``(name, staged chunks)`` job as ``options`` say; return the files'
        records as the child sent them (:class:`~shardkit.checkpoint.training.save.RelayedFile`)."""
        assert pool.buffer is not None and pool.buffer.path is not None
        request = {"url": storage.url, "options": storage_options, "buffer": pool.buffer.path,
                   "token": pool.buffer.token, "size": pool.buffer.size, "writer": writer,
                   "io_threads": options.io_threads, **writer_fields(options),
                   "files": [{"name": name, "chunks": [[c.fqn, dtype_to_code(c.dtype), list(c.offsets), list(c.shape),
                                                        None if c.tensor_shape is None else list(c.tensor_shape),
                                                        pool.location(c)] for c in chunks]}
                             for name, chunks in jobs]}
        line, proc = self._ask(json.dumps(request, separators=(",", ":")).encode() + b"\n")
        if not line:
            raise CheckpointError(f"the async save writer process (pid {proc.pid}) {_exit_status(proc)} while "
                                  f"writing {storage.url}; nothing was committed, the checkpoint there before "
                                  f"this save is untouched, and the next save starts a new writer")
        pool.buffer.mapped()
        reply = json.loads(line)
        if reply.get("error") is not None:
            raise from_record(reply["error"])
        return [RelayedFile.of(f) for f in reply["files"]]

    def commit(self, storage: Storage, storage_options: dict[str, Any], options: SaveOptions, plan: SavePlan,
               reports: Sequence[bytes], world_size: int) -> dict[str, str] | None:
        """Have the child commit rank 0's save from every rank's ``reports`` (their JSON, passed on undecoded:
        :mod:`~shardkit.checkpoint.training.async_save.writer_commit` says why); the error record every rank
        raises, or ``None`` once committed.

        A child that dies on it may have published the manifest just before: once it is gone (it can
        rename nothing any more), the storage says -- committed where the manifest there lists the files
        the ranks reported, so no rank removes files a committed checkpoint references."""
        line, proc = self._ask(self._commits.encode(storage, storage_options, options, plan, reports, world_size))
        if not line:
            names = {f.name for raw in reports for f in getattr(report_from_json(json.loads(raw)), "files", ())}
            return outcome_from_storage(storage, names, f"the async save writer process (pid {proc.pid}) "
                                        f"{_exit_status(proc)} while committing {storage.url}")
        reply = json.loads(line)
        if reply.get("error") is not None:
            return reply["error"]
        if reply["commit_error"] is None:
            log.info("committed %s", storage.url)
        return reply["commit_error"]

    def _ask(self, request: bytes) -> tuple[bytes, subprocess.Popen]:
        """Send one request line; its reply line (empty when the child died), and the child asked."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                return proc.stdout.readline(), proc
            except (BrokenPipeError, OSError):
                return b"", proc

    def close(self) -> None:
        """End the child (it finishes the request in hand first, if any)."""
        proc, self._proc = self._proc, None
        if proc is None or os.getpid() != self._owner:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def _exit_status(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "stopped answering and was killed"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# -- the child ---------------------------------------------------------------


class _Buffer:
    """The training process's staging buffer, mapped into the child (one at a time: it only grows)."""

    def __init__(self) -> None:
        self.token: str | None = None
        self.tensor: torch.Tensor | None = None
        self._mmap: Any = None

    def open(self, path: str, token: str, size: int) -> torch.Tensor:
        """The buffer ``token`` (mapped from ``path`` the first time it is named)."""
        import mmap

        if token != self.token or self.tensor is None or self.tensor.numel() != size:
            self.tensor, self.token = None, None
            if self._mmap is not None:
                try:
                    self._mmap.close()
                except BufferError:  # a view outlived its request; the mapping goes with it
                    pass
            fd = os.open(path, os.O_RDWR)
            try:
                self._mmap = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.tensor, self.token = torch.frombuffer(self._mmap, dtype=torch.uint8), token
        return self.tensor


def _chunk(buffer: torch.Tensor, fields: list[Any]) -> WriteChunk:
    fqn, code, offsets, shape, tensor_shape, at = fields
    dtype = code_to_dtype(code)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = buffer[at:at + nbytes]
    data = raw.view(dtype).view(shape) if shape else raw.view(dtype)[0]
    return WriteChunk(fqn, dtype, tuple(offsets), tuple(shape), data,
                      None if tensor_shape is None else tuple(tensor_shape))


def _serve(request: dict[str, Any], buffer: _Buffer) -> list[dict[str, Any]]:
    data = buffer.open(request["buffer"], request["token"], request["size"])
    writer = native_writer(request)
    jobs = [(f["name"], [_chunk(data, c) for c in f["chunks"]]) for f in request["files"]]
    files = parallel_map(lambda job: writer.write_file(job[0], job[1], request["writer"]), jobs,
                         request["io_threads"])
    return [f.to_json() for f in files]


def _die_with(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the request above took effect
        sys.exit(0)


def main(argv: Sequence[str]) -> int:
    parent = int(argv[argv.index("--parent") + 1])
    _die_with(parent)
    if hasattr(os, "nice"):
        os.nice(WRITER_NICENESS)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    torch.set_num_threads(1)
    buffer = _Buffer()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            reply: dict[str, Any] = (serve_commit(request) if request.get("kind") == COMMIT_KIND else
                                     {"files": _serve(request, buffer)})
        except Exception as exc:  # noqa: BLE001 - reported to the training process, which raises it
            if not isinstance(exc, ShardkitError):
                exc = CheckpointError(f"the async save writer process failed: {type(exc).__name__}: {exc}")
            reply = {"error": error_record(exc)}
        replies.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
