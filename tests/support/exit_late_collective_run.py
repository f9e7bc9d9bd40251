"""The last collective on a gloo group finishes while rank 0 is already exiting.

    exit_late_collective_run.py OUT shardkit|kept    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment)

``shardkit``: the group is the one ``async_save`` makes for itself (each rank
async-saves a small state dict and waits for it), and the program keeps no
reference to it.  ``kept``: no shardkit at all; the program makes a group with
``new_group`` and a module-level cache keeps it past ``destroy_process_group()``,
as shardkit's caches used to.

Then the script makes happen on purpose what a busy machine makes happen now
and then: a collective on that group finishes after rank 0 left its program.
Rank 0 starts an all-reduce on the group and lets go of its work, destroys its
default group, runs its exit functions (shardkit's among them), and leaves two
more: one that records how many groups made by ``new_group`` are still alive
and tells rank 1 to join the all-reduce (``OUT/rank0-exiting``), then one that
holds the GIL in C for ``HOLD_S`` seconds, after which the interpreter
finalizes.  The gloo worker that finishes the all-reduce frees the work and
with it the wrapper of the tensor, which takes the GIL: if the group is still
alive, the worker waits for the GIL into finalization, where CPython ends it
inside a C++ destructor and the process aborts (SIGABRT, ``terminate called
without an active exception``).  A group destroyed at exit, before
finalization, has no worker left by then, and rank 0 exits 0.

Rank 0 writes ``OUT/rank0.json``: ``{"alive": groups made by new_group still alive at its last exit function}``.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

HOLD_S = 2  # rank 0's last exit function holds the GIL this long: rank 1 joins meanwhile
RANK_1_WAITS_AT_MOST_S = 3.0  # rank 0 may be destroying the group, which waits for this all-reduce
CACHE: dict = {}  # mode "kept": a module-level cache holding the group, the way a library might


def record_new_groups() -> list:
    """Weak references to every group ``torch.distributed.new_group`` makes from now on."""
    made: list = []
    original = dist.new_group

    def new_group(*args, **kwargs):
        group = original(*args, **kwargs)
        made.append(weakref.ref(group))
        return group

    dist.new_group = new_group
    return made


def main(out: Path, mode: str) -> None:
    made = record_new_groups()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "shardkit":
        import shardkit.checkpoint as skc

        skc.async_save({"w": torch.arange(8.0)}, str(out / "ckpt"), writer="thread").result()
    else:
        CACHE["group"] = dist.new_group(backend="gloo")
    [group] = [ref() for ref in made]
    dist.barrier()
    held = torch.ones(4)  # kept by Python: freeing a work that used it touches its wrapper
    if rank == 0:
        work = dist.all_reduce(held, group=group, async_op=True)
        del work, group  # from here on, the program holds neither
        dist.destroy_process_group()
        atexit._run_exitfuncs()  # the program's and shardkit's exit functions, as at any exit

        def report_and_let_rank_1_join() -> None:
            (out / "rank0.json").write_text(json.dumps({"alive": sum(ref() is not None for ref in made)}))
            (out / "rank0-exiting").touch()

        atexit.register(ctypes.PyDLL(None).sleep, HOLD_S)  # runs last; a PyDLL call keeps the GIL
        atexit.register(report_and_let_rank_1_join)
    else:
        deadline = time.monotonic() + RANK_1_WAITS_AT_MOST_S
        while not (out / "rank0-exiting").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        dist.all_reduce(held, group=group)
        del group
        CACHE.clear()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
