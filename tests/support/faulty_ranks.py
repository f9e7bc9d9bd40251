"""Run a function on N gloo ranks of which one will die, freeze or fail, and hear from every survivor.

:func:`tests.support.dist.run_on_ranks` gives up on the others a few seconds after one rank dies (its
grace period), and waits for every rank's answer: right for tests where a failure is a bug, wrong where
one rank's death *is* the test and the point is what the other ranks do next, and when.  Here every rank
is a fresh process (forked from the same preloaded fork server), each one writes its outcome to a JSON
file the moment it has one -- its return value, or the exception it raised with the wall-clock time it
raised it -- and the test process collects whatever files exist once every rank has ended or the
deadline passed.  Whatever is left then (a ``SIGSTOP``ped rank, a survivor still waiting) is resumed
and killed, so nothing outlives the call.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from tests.support.dist import PRELOADED

PG_TIMEOUT_S = 120.0  # the process group's own timeout: far above the checkpoint deadline the tests set


def _rank_entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str,
                environ: dict[str, str]) -> None:
    os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True",
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        outcome = {"ok": True, "value": fn(*args)}
    except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the test
        outcome = {"ok": False, "type": type(exc).__name__, "kinds": [k.__name__ for k in type(exc).__mro__],
                   "message": str(exc), "at": time.time(), "traceback": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    os._exit(0)  # no teardown of a process group whose peers are dead or frozen


def run_with_a_fault(world_size: int, fn: Callable[..., Any], *args: Any, out_dir: str | os.PathLike,
                     timeout: float = 60.0, faulty: int | None = None) -> dict[int, dict[str, Any] | None]:
    """``fn(*args)`` on ``world_size`` fresh gloo ranks; each rank's outcome (``None`` for a rank that left
    none: killed, frozen).  ``fn`` must be importable by name; the outcome of a rank is ``{"ok": True,
    "value": ...}`` or ``{"ok": False, "type", "kinds" (its classes' names), "message", "at" (time.time()
    when it was caught), "traceback"}``.  ``faulty``: the rank that will not end by itself (frozen, or
    busy elsewhere), not waited for once every other rank has ended."""
    from torch.distributed import TCPStore

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    procs = [ctx.Process(target=_rank_entry, args=(r, world_size, store.port, fn, args, str(out), dict(os.environ)),
                         name=f"shardkit-faulty-rank{r}") for r in range(world_size)]
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        others = [p for r, p in enumerate(procs) if r != faulty]
        while time.monotonic() < deadline and any(p.is_alive() for p in others):
            time.sleep(0.1)
        if faulty is not None:  # a frozen rank is not waited for once every other rank is done
            procs[faulty].join(0 if not procs[faulty].is_alive() else 0.5)
    finally:
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process is resumed, then ended
                    try:
                        os.killpg(proc.pid, sig)  # the rank and all it started (its own session)
                    except (ProcessLookupError, PermissionError):
                        try:
                            os.kill(proc.pid, sig)  # killed before it made its session
                        except ProcessLookupError:
                            pass
            proc.join(10)
    outcomes: dict[int, dict[str, Any] | None] = {}
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        outcomes[rank] = json.loads(path.read_text()) if path.exists() else None
    del store
    return outcomes


def mark(out_dir: str | os.PathLike, name: str) -> None:
    """Record ``time.time()`` under ``name`` (a rank about to die or freeze says when).  Written whole, then
    renamed: several of the rank's writer threads may strike at once, and the first one's kill must never
    leave another's truncated file behind."""
    final = Path(out_dir, f"{name}.time")
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(repr(time.time()))
    os.replace(tmp, final)


def marked(out_dir: str | os.PathLike, name: str) -> float:
    return float(Path(out_dir, f"{name}.time").read_text())
