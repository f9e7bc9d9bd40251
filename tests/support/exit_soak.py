"""Launch a 2-rank training script many times and count how its ranks exit: the exit soak.

    python tests/support/exit_soak.py LAUNCHES AT_ONCE OUT [script arguments...]

:func:`exit_soak` is the loop (the suite runs 20 launches, ``benchmarks/exit_soak.py``
100).  Each launch runs ``exit_module_level_run.py`` -- model, optimizer and an
async, hot-tier ``CheckpointManager`` at module level -- on two gloo ranks with
the environment torchrun gives its workers, and each rank leaves through the
interpreter's own exit (threads joined, exit functions, finalization), which is
where an exit-time abort happens.

Why fork instead of torchrun: each process importing torch spends seconds of
CPU, and a soak of dozens of launches would spend minutes on imports alone.
This launcher imports torch, ``torch._dynamo`` and shardkit once and forks every
rank from itself while it runs no other thread (checked); a rank executes the
script as a fresh ``__main__`` module, so its globals live until finalization
exactly as a script's do under torchrun.  ``AT_ONCE`` launches run together, so
they load each other as on a busy machine.

Prints one JSON line (the dict :func:`exit_soak` returns).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Callable

import torch  # noqa: F401 - imported once here, inherited by every forked rank
import torch._dynamo  # noqa: F401 - likewise: every rank's first DTensor would import it (two seconds of CPU)

import shardkit.checkpoint.training.manager  # noqa: F401 - likewise

SCRIPT = Path(__file__).resolve().parent / "exit_module_level_run.py"
RANKS = 2
RANK_TIMEOUT_S = 120.0
ABORT_LINE = "terminate called"
LAST_STEP = 2  # exit_module_level_run.py's last step: committed under OUT/launch<i>/ckpt by a clean run


def start_store_host() -> tuple[int, int]:
    """Fork a process that hosts one launch's TCPStore, as torchrun's agent does; return ``(its pid, its port)``.

    The store binds port 0 and says which port the kernel gave it: a port picked as free and bound later by
    rank 0 can be taken in between by any other process on the machine (the suite runs several at once), and
    that launch fails with ``EADDRINUSE``.  The host starts the store's threads in itself, after the fork, so
    the launcher stays single-threaded; the ranks join it with ``TORCHELASTIC_USE_AGENT_STORE=True``.  It
    lives until the launcher kills it (:func:`fork_launches`, once the launch's ranks are gone)."""
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(readable)
        try:
            import torch.distributed as dist

            store = dist.TCPStore("127.0.0.1", 0, RANKS, is_master=True, wait_for_workers=False)
            os.write(writable, str(store.port).encode())
            os.close(writable)
            while True:
                signal.pause()
        finally:
            os._exit(1)
    os.close(writable)
    with os.fdopen(readable, "rb") as said:
        port = said.read()
    if not port:
        os.waitpid(pid, 0)
        raise RuntimeError("the store host of a launch exited before saying its port")
    return pid, int(port)


def run_rank(script: Path, launch: int, rank: int, port: int, out: Path, script_args: list[str]) -> None:
    """In the forked child: become rank ``rank`` of launch ``launch``, run ``script`` as ``__main__``, exit."""
    log = os.open(out / f"launch{launch}-rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_WORLD_SIZE=str(RANKS),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    sys.modules["__main__"] = main  # the script's globals stay referenced into finalization, as a script's do
    sys.argv = [str(script), str(out / f"launch{launch}"), *script_args]
    code = 0
    try:
        exec(compile(script.read_text(), str(script), "exec"), main.__dict__)  # noqa: S102 - our own test script
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed like an uncaught exception, exit 1 like Python's
        traceback.print_exc()
        code = 1
    raise SystemExit(code)  # up through the launcher's frames: the interpreter's own exit, finalization included


def threads_running() -> int:
    return len(os.listdir("/proc/self/task"))


def fork_launches(launches: int, at_once: int, out: Path,
                  start_rank: Callable[[int, int, int], None]) -> tuple[dict[str, int], list[dict]]:
    """Fork two ranks per launch, ``at_once`` launches together, each child calling ``start_rank(launch,
    rank, port)`` (which must not return: it leaves through ``SystemExit``); wait for all of them.  Returns
    ``({exit code: ranks}, [{"launch", "rank", "code", "log"} of each rank that did not exit 0])``; a rank that
    outlives ``RANK_TIMEOUT_S`` is killed and counted with code ``"timeout"``.  Call it from a process that
    runs no other thread, with no ``with`` or ``finally`` around the call (each child leaves up through the
    caller's frames).  The inherited heap is frozen first: the collector leaves it alone in every rank
    instead of writing to each page it visits (and so copying it)."""
    out.mkdir(parents=True, exist_ok=True)
    gc.freeze()
    waiting = list(range(launches))
    running: dict[int, tuple[int, int, float]] = {}  # pid -> (launch, rank, deadline)
    store_hosts: dict[int, int] = {}  # launch -> its store host's pid
    codes: dict[str, int] = {}
    failed: list[dict] = []

    def rank_gone(launch: int) -> None:
        if launch in store_hosts and not any(other == launch for other, _, _ in running.values()):
            host = store_hosts.pop(launch)
            os.kill(host, signal.SIGKILL)
            os.waitpid(host, 0)

    while waiting or running:
        while waiting and len(running) < at_once * RANKS:
            launch = waiting.pop(0)
            store_hosts[launch], port = start_store_host()
            if threads_running() != 1:
                raise RuntimeError(f"the launcher runs {threads_running()} threads: forking it would copy a "
                                   f"process whose other threads are gone in the child")
            for rank in range(RANKS):
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    start_rank(launch, rank, port)
                running[pid] = (launch, rank, time.monotonic() + RANK_TIMEOUT_S)
        pid, status = os.waitpid(-1, os.WNOHANG)  # store hosts are only ever reaped by rank_gone: alive till then
        if pid == 0:
            for pid, (launch, rank, deadline) in list(running.items()):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    del running[pid]
                    rank_gone(launch)
                    codes["timeout"] = codes.get("timeout", 0) + 1
                    failed.append({"launch": launch, "rank": rank, "code": "timeout"})
            time.sleep(0.02)
            continue
        if pid not in running:  # a store host that died on its own: its launch's ranks fail on their own
            for launch in [launch for launch, host in store_hosts.items() if host == pid]:
                del store_hosts[launch]
            continue
        launch, rank, _ = running.pop(pid)
        rank_gone(launch)
        code = str(os.waitstatus_to_exitcode(status))
        codes[code] = codes.get(code, 0) + 1
        if code != "0":
            failed.append({"launch": launch, "rank": rank, "code": code})
    for entry in failed:
        entry["log"] = (out / f"launch{entry['launch']}-rank{entry['rank']}.log").read_text(errors="replace")[-2000:]
    return codes, failed


def exit_soak(launches: int, at_once: int, out: Path, script_args: list[str] = (),
              script: Path = SCRIPT) -> dict:
    """Launch ``script`` ``launches`` times on two ranks, ``at_once`` launches together; return
    ``{"launches", "ranks", "exit_codes": {code: ranks}, "aborts": ranks killed by SIGABRT,
    "terminate_called": ranks whose output says "terminate called", "last_step_committed": launches whose
    last step is committed, "failed": [{"launch", "rank", "code", "log"}]}`` (see :func:`fork_launches`)."""
    codes, failed = fork_launches(launches, at_once, out, lambda launch, rank, port: run_rank(
        script, launch, rank, port, out, list(script_args)))
    terminate_called = 0
    for launch in range(launches):
        for rank in range(RANKS):
            terminate_called += ABORT_LINE in (out / f"launch{launch}-rank{rank}.log").read_text(errors="replace")
    last = f"step-{LAST_STEP:010d}"
    committed = sum((out / f"launch{launch}" / "ckpt" / last / "manifest.json").exists() for launch in range(launches))
    return {"launches": launches, "ranks": launches * RANKS, "exit_codes": codes,
            "aborts": codes.get(str(-signal.SIGABRT), 0), "terminate_called": terminate_called,
            "last_step_committed": committed, "failed": failed}


def main(argv: list[str]) -> None:
    launches, at_once, out = int(argv[0]), int(argv[1]), Path(argv[2])
    print(json.dumps(exit_soak(launches, at_once, out, argv[3:])), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
