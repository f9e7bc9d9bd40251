"""The arms of ``benchmarks/goodput.py`` (its docstring says what each is and why) and one arm's saves under its
system: start a save, guard the optimizer step, wait for the commit, load the last checkpoint back and check it
bitwise.  Both measures of the job (:mod:`goodput_job`: paired blocks, whole runs) save through this one class,
so an arm saves the same way in both."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import peers_systems as ps  # beside this file (goodput.py puts benchmarks/ on sys.path)
import torch
import torch.distributed as dist

ARMS = ("shardkit-async", "shardkit-hot", "dcp-async", "torch_checkpointing-async")  # each paired with its baseline
RUNTIME = {"none/shardkit": "shardkit", "shardkit-async": "shardkit", "shardkit-hot": "shardkit"}  # else torch
SYSTEM = {"shardkit-async": "shardkit", "shardkit-hot": "shardkit", "dcp-async": "dcp",
          "torch_checkpointing-async": "torch_checkpointing"}


def runtime_of(arm: str) -> str:
    """The runtime an arm (or a baseline, ``none/<runtime>``) trains under: ``"shardkit"`` or ``"torch"``."""
    return RUNTIME.get(arm, "torch")


def baseline_of(arm: str) -> str:
    return f"none/{runtime_of(arm)}"


class Saver:
    """One arm's saves: ``start(step)`` begins a save of the state at ``step`` (after the previous committed);
    ``lock()`` guards the optimizer step; ``wait_commit()`` waits for the last; ``resume()`` loads it back."""

    def __init__(self, arm: str, model: Any, opt: Any, root: str, shm: str, every: int, group: Any) -> None:
        self.arm, self.model, self.opt, self.root, self.every, self.group = arm, model, opt, root, every, group
        self.future: Any = None
        self.lags: list[float] = []
        self.saves = 0
        self.last = ""
        self.hot_args = dict(keep_last=2, async_save=True, local=os.path.join(shm, "node{node}"),
                             local_world_size=1, replicas=1, local_keep=2, durable_every=every)
        self.hot = self.tc = None
        if arm == "shardkit-hot":
            import shardkit.checkpoint as skc

            self.hot = skc.CheckpointManager(root, **self.hot_args)
        elif arm == "torch_checkpointing-async":
            self.tc = ps.tc_manager(async_save=True)

    def state(self) -> dict[str, Any]:
        return ps.state_of(SYSTEM[self.arm], self.model, self.opt)

    def due(self, step: int) -> bool:
        return self.arm == "shardkit-hot" or (self.arm in SYSTEM and step % self.every == 0)

    def start(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        import shardkit.checkpoint as skc

        if self.future is not None:
            self.future.result()
        self.saves += 1
        self.last = os.path.join(self.root, f"step-{step}")
        started = time.perf_counter()
        if self.arm == "shardkit-hot":
            future = self.hot.save(step, self.model, self.opt)
        elif self.arm == "shardkit-async":
            future = skc.async_save(self.state(), self.last, process_group=self.group)
        elif self.arm == "dcp-async":
            future = dcp.async_save(self.state(), checkpoint_id=self.last, process_group=self.group)
        else:
            future = self.tc.save(self.last, self.state())
        self.future = future
        future.add_done_callback(lambda _: self.lags.append(time.perf_counter() - started))

    def lock(self) -> Any:
        return self.tc.lock() if self.tc is not None else contextlib.nullcontext()

    def wait_commit(self) -> None:
        """Wait for the save in flight to commit (and the hot manager's retention): the wait the next save
        starts with, on the clock wherever it is timed."""
        if self.future is not None:
            self.future.result()
        if self.hot is not None:
            self.hot.wait()

    def settle(self) -> None:
        """After :meth:`wait_commit`, off the clock: until every save's lag is recorded (the callbacks run on
        the saver's thread just after its future is done)."""
        while len(self.lags) < self.saves:
            time.sleep(0.001)

    def forget(self) -> None:
        """Count nothing so far (after the untimed first save)."""
        self.saves, self.lags = 0, []

    def warm_up(self, step: int) -> None:
        """The first save, untimed, waited for: writer processes up and staging buffers allocated, the steady
        state of a long run (torch_checkpointing's first async save spawns its writer: seconds)."""
        if self.arm in SYSTEM:
            self.start(step)
            self.wait_commit()
            self.settle()
            self.forget()

    def resume(self, final_step: int) -> None:
        """Load the last checkpoint back into the (zeroed) model and optimizer with the system's own load."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        import shardkit.checkpoint as skc

        if self.arm == "shardkit-hot":
            manager = skc.CheckpointManager(self.root, **self.hot_args)
            manager.load_latest(self.model, self.opt, required=True)
            if manager.last_load.step != final_step:
                raise SystemExit(f"{self.arm}: resumed step {manager.last_load.step}, want {final_step}")
            return
        state = self.state()
        if self.arm == "shardkit-async":
            skc.load(state, self.last)
            skc.set_training_state(self.model, self.opt, state)
            return
        if self.arm == "dcp-async":
            dcp.load(state, checkpoint_id=self.last)
        else:
            manager = ps.tc_manager(async_save=False)
            state = dict(manager.load(self.last, into=state))
            manager.close()
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def timed_resume(self, final_step: int) -> float:
        """Snapshot the state (its last save is of it), zero it, :meth:`resume`, compare bitwise; the resume's
        seconds on this rank.  A state that differs stops the benchmark."""
        snapshot = {k: ps.local(t).clone() for k, t in ps.tensors(self.state()).items()}
        for t in ps.tensors(self.state()).values():
            ps.local(t).zero_()
        dist.barrier()
        t0 = time.perf_counter()
        self.resume(final_step)
        seconds = time.perf_counter() - t0
        after = {k: ps.local(t) for k, t in ps.tensors(self.state()).items()}
        bad = [k for k, t in snapshot.items() if k not in after or not torch.equal(t, after[k])]
        if bad:
            raise SystemExit(f"{self.arm}: the resumed state differs from the saved one, e.g. {bad[:3]}")
        return seconds

    def close(self) -> None:
        if self.tc is not None:
            self.tc.close()
