"""Run a function on N real gloo ranks on CPU, the way torchrun launches them.

Every multi-rank test goes through :func:`run_on_ranks`::

    def _train_two_steps(lr):            # module level: it travels to the ranks by name
        ...
        return losses                     # anything picklable comes back

    def test_losses_match():
        per_rank = run_on_ranks(2, _train_two_steps, 0.1)

How it mirrors torchrun: the test process plays the elastic agent.  It hosts
the TCPStore on a free loopback port, and each rank is a process of its own,
forked from multiprocessing's fork server with torch already imported (see
:func:`_rank_context`), with the test process's environment plus
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` and ``TORCHELASTIC_USE_AGENT_STORE=True``,
joining the default process group through ``env://`` with the gloo backend.

Why a pool: forming a process group and a rank's first collectives cost
time, and the whole suite must run within twenty minutes on two cores.
Ranks therefore stay up between tests, one pool per world size, and run one
function after another.  A pool that saw any failure is torn down and rebuilt
on next use, so a broken process group never leaks into the next test.  So
is, between two tests, a pool whose ranks have gathered too many process
groups (idle gloo groups go on polling: see :func:`recycle_crowded_pools`).

Failure semantics, which the tests rely on:

* The process-group timeout is short (``SHARDKIT_TEST_PG_TIMEOUT``, default
  20 s), so a mismatched collective fails in seconds instead of hanging.
* Any rank's exception fails the call with that rank's traceback; ranks that
  are left waiting in a collective get a short grace period and are killed.
* Each rank runs in its own session (process group) with every process it
  starts, and a watchdog thread ends it when the test process disappears:
  no orphaned processes, even after ``kill -9`` of pytest.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

PG_TIMEOUT_S = float(os.environ.get("SHARDKIT_TEST_PG_TIMEOUT", "20"))
DEFAULT_CALL_TIMEOUT_S = 180.0
POOL_MAX_THREADS = int(os.environ.get("SHARDKIT_TEST_POOL_MAX_THREADS", "64"))  # see recycle_crowded_pools
_GRACE_AFTER_FAILURE_S = 3.0


class RankFailure(AssertionError):
    """One or more ranks raised, died or timed out; the message holds their tracebacks."""


# --------------------------------------------------------------------------
# inside each rank


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (its ``kill -9``ed corpse, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _watch_test_process(pid: int) -> None:
    """End this rank when the test process ``pid`` is gone.  Not its parent: that is the fork server,
    which lives on while any rank forked from it does."""
    while _running(pid):
        time.sleep(0.5)
    os._exit(3)


def _forget_sharding_decisions() -> None:
    """Empty DTensor's sharding-propagation caches (what ``torch.distributed.tensor.debug._clear_sharding_prop_cache``
    does, without importing that module's debug tools).

    They are keyed by meshes that compare equal by shape, ranks and dim names, and their answers carry the
    mesh objects of the call that filled them: an op on a DTensor of this call's mesh (``nn.Parameter(dtensor)``
    is one) could come back on an equal mesh an earlier call built, whose groups may be gone, and
    ``fully_shard`` wants the very mesh object it is given.  Emptied before every call, each call meets its own
    meshes only, as in a fresh process.  Both caches are per thread; calls run on this (the main) thread.
    """
    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor yet: nothing cached
    import torch
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def _rank_main(rank: int, world_size: int, port: int, conn: Connection, test_pid: int,
               environ: dict[str, str]) -> None:
    os.setsid()  # one killable process group for this rank and all it spawns
    # the fork server's imports (torch's modules, hundreds of thousands of objects) live as long as the rank:
    # frozen, the rank's collector no longer walks them at every full collection, copying each page it visits
    gc.freeze()
    threading.Thread(target=_watch_test_process, args=(test_pid,), daemon=True).start()
    os.environ.clear()  # the test process's environment now, not the fork server's from when it started
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS="1",
    )
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        fn, args, kwargs = task
        _forget_sharding_decisions()
        try:
            outcome = ("ok", fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            outcome = ("error", traceback.format_exc())
        try:
            conn.send(outcome)
        except Exception:  # an unpicklable result is the test's bug; say so
            conn.send(("error", f"rank {rank}: result could not be sent back:\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


# --------------------------------------------------------------------------
# in the test process


# What every rank imports before its first call: imported once, in the fork server that forks the ranks
PRELOADED = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo"]


def _rank_context() -> multiprocessing.context.BaseContext:
    """Ranks are forked from multiprocessing's fork server, which has imported ``PRELOADED``.

    Importing torch costs a rank seconds of CPU, and its first DTensor imports ``torch._dynamo``
    (seconds more); a suite starts ranks a hundred times (a pool per world size, again after every
    failure, crowding or ``isolated`` call).  The server is a single-threaded process that imported
    them once and formed no process group; each rank forked from it starts with them imported and
    nothing else of the test process.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    return ctx


class _RankPool:
    """``world_size`` live ranks sharing one gloo process group."""

    def __init__(self, world_size: int) -> None:
        from torch.distributed import TCPStore

        self.world_size = world_size
        self.store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        ctx = _rank_context()
        self.conns: list[Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, world_size, self.store.port, child_end, os.getpid(), dict(os.environ)),
                name=f"shardkit-rank{rank}-of-{world_size}",
            )
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)
        self._collect(timeout=120.0, what="process-group start-up")

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        return self._collect(timeout, what=getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, timeout: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                         timeout=deadline - now)
            for rank in list(pending):
                conn, proc = self.conns[rank], self.procs[rank]
                if conn in ready:
                    try:
                        status, payload = conn.recv()
                    except EOFError:
                        status, payload = "error", f"rank {rank} closed its pipe (exit code {proc.exitcode})"
                    pending.discard(rank)
                    if status == "error":
                        errors[rank] = payload
                    else:
                        results[rank] = payload
                elif proc.sentinel in ready and not conn.poll():
                    pending.discard(rank)
                    proc.join(0.1)
                    errors[rank] = f"rank {rank} died with exit code {proc.exitcode}"
            if errors and pending:
                # ranks still inside a collective with a failed peer: short grace, then give up
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
        if pending or errors:
            self.close(force=True)
            parts = [f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)]
            parts += [f"--- rank {r} ---\nno answer (killed after the deadline)" for r in sorted(pending)]
            raise RankFailure(f"{what} failed on {self.world_size} ranks:\n" + "\n".join(parts))
        return [results[r] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for conn in self.conns:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            for proc in self.procs:
                proc.join(5)
        for proc in self.procs:
            if proc.pid is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            proc.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


_pools: dict[int, _RankPool] = {}


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_CALL_TIMEOUT_S,
    isolated: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on every rank of a ``world_size`` gloo group.

    Returns the per-rank return values in rank order.  Raises
    :class:`RankFailure` carrying each failing rank's traceback when any rank
    raises, dies, or does not answer within ``timeout`` seconds.
    ``fn`` must be importable by name (defined at module level).

    Every call starts with DTensor's sharding caches empty (see
    :func:`_forget_sharding_decisions`), so meshes built by earlier calls on
    the same ranks never come back in this one.

    ``isolated=True`` runs ``fn`` on ranks started for this call alone and
    stopped after it.  Use it when ``fn`` changes process-wide state that
    later tests must not inherit, above all when it destroys and re-forms the
    default process group.  Ranks cost seconds of CPU to start: do not
    isolate a call for what the emptied caches already give.
    """
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size must be in 1..8, got {world_size}")
    if isolated:
        own = _RankPool(world_size)
        try:
            result = own.run(fn, args, kwargs, timeout)
        except BaseException:
            own.close(force=True)
            raise
        own.close()
        return result
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(force=True)
        pool = _pools[world_size] = _RankPool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except RankFailure:
        _pools.pop(world_size, None)
        raise


def _threads(pid: int | None) -> int:
    """How many threads process ``pid`` runs (0 where that cannot be read)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def recycle_crowded_pools(max_threads: int = POOL_MAX_THREADS) -> None:
    """Stop each pool whose ranks run more than ``max_threads`` threads; the next call starts a fresh one.

    Every process group a test forms in the ranks (each mesh dimension, each ``new_group``) stays
    there after the test, and with gloo each one keeps about three threads that go on polling when
    idle: a rank holding 100 idle groups burns 14% of a core here, so after a few hundred meshes
    the idle pools take a whole core from whatever runs next.  Called between tests only
    (tests/conftest.py), never between two calls of one test, so a test sees one pool throughout,
    as when an earlier test's failure replaced it.
    """
    for world_size, pool in list(_pools.items()):
        if pool.procs and _threads(pool.procs[0].pid) > max_threads:
            _pools.pop(world_size)
            pool.close()


def shutdown_pools() -> None:
    """Stop every live rank (also registered at interpreter exit)."""
    while _pools:
        _, pool = _pools.popitem()
        pool.close()


atexit.register(shutdown_pools)


def run_torchrun(
    script: str | os.PathLike,
    nproc: int,
    args: Sequence[str] = (),
    *,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    launcher_args: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """Launch ``torchrun --standalone --nproc_per_node nproc [launcher_args] script args`` and wait.

    Output is captured.  On timeout the whole process tree is killed and a
    ``subprocess.TimeoutExpired`` is raised, so a hung example cannot outlive the test.
    ``launcher_args`` are torchrun's own options (``--max-restarts 1``).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *launcher_args, str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
