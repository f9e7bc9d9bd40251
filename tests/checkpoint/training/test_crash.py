"""Crash safety: SIGKILL a process that saves in a loop; the newest committed step always loads intact."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import psutil
import pytest
import torch
import torch.nn as nn

import shardkit.checkpoint as skc

KILLS = 20
WRITER_EXIT_S = 30  # for a killed saver (and its writer process) to be gone: seconds on a loaded machine
COMMIT_WAIT_S = 120  # for a fresh saver's first commit (it may start a writer process that imports torch)


class _Blob(nn.Module):
    """About 2.3 MB of state in tensors of several sizes, so a save spans many chunks and two files."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.zeros(300, 1000))
        self.mid = nn.Parameter(torch.zeros(257, 97))
        self.small = nn.Parameter(torch.zeros(13))
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))


def _fill(model: _Blob, step: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + 1000.0 * step + i)
        model.counter.fill_(step)


def _is_step(model: _Blob, step: int) -> bool:
    expected = _Blob()
    _fill(expected, step)
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))


def _save_forever(root: str, options: dict | None, start: int, report: str, writer: str | None) -> None:
    """Save steps until killed; ``writer`` set: background saves through that async_save writer."""
    torch.set_num_threads(1)
    model = _Blob()
    manager = skc.CheckpointManager(root, keep_last=2, storage_options=options, chunk_bytes=256 << 10,
                                    **({"async_save": True, "writer": writer} if writer else {}))
    manager.load_latest(_Blob())  # a restarted job resumes first: the steps below are its run's to retain
    step = start
    while True:
        _fill(model, step)
        future = manager.save(step, model, extra={"step": step})
        if future is not None:
            _fill(model, -1)  # training goes on while the save is written
            future.result()
        with open(report, "a") as f:  # the step is committed once save() (or its future) returned
            f.write(f"{step}\n")
        step += 1


def _writers_of(pid: int) -> list[int]:
    """Live async_save writer processes started by process ``pid``."""
    found = []
    for child in psutil.process_iter(["cmdline"]):
        cmdline = child.info["cmdline"] or []
        if "shardkit.checkpoint.training.async_save.writer_process" in cmdline and cmdline[-1] == str(pid):
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    found.append(child.pid)
            except psutil.NoSuchProcess:
                pass
    return found


def _wait_for_a_commit_after(report: str, step: int, saver: multiprocessing.process.BaseProcess) -> None:
    """Wait until ``saver`` reports a step newer than ``step`` committed (at most ``COMMIT_WAIT_S``)."""
    deadline = time.monotonic() + COMMIT_WAIT_S
    while _last_reported(report) <= step:
        assert saver.is_alive(), "the saver died before its first commit"
        assert time.monotonic() < deadline, f"no step committed within {COMMIT_WAIT_S} s"
        time.sleep(0.05)


def _save_forever_once(root: str, options: dict | None) -> None:
    model = _Blob()
    skc.CheckpointManager(root, storage_options=options).save(0, model)
    skc.CheckpointManager(root, storage_options=options).load_latest(model)


def _last_reported(report: str) -> int:
    try:
        with open(report) as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
    except FileNotFoundError:
        return -1
    return int(lines[-1]) if lines else -1


def _kill_loop(root: str, options: dict | None, report: str, seed: int, delays: tuple[float, float],
               kills: int = KILLS, writer: str | None = None) -> list[int]:
    # one save in this process first, so the forked savers start with every module imported
    _save_forever_once(f"{root}-warmup", options)
    # step 0 committed before the first kill, so every kill lands where a committed step must survive
    # (on a loaded machine a saver killed before its first commit would otherwise prove nothing)
    seed_model = _Blob()
    _fill(seed_model, 0)
    skc.CheckpointManager(root, storage_options=options).save(0, seed_model, extra={"step": 0})
    with open(report, "a") as f:
        f.write("0\n")
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(seed)
    checker = skc.CheckpointManager(root, storage_options=options)
    loaded_steps = []
    for kill in range(kills):
        steps = checker.steps()
        proc = ctx.Process(target=_save_forever,
                           args=(root, options, (steps[-1] + 1) if steps else 0, report, writer))
        proc.start()
        if kill == kills - 1:
            # the last kill waits for one more commit first, so the loop proves a step committed between
            # kills survives too, however slow a loaded machine makes the savers
            _wait_for_a_commit_after(report, steps[-1] if steps else -1, proc)
        time.sleep(rng.uniform(*delays))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(WRITER_EXIT_S)
        assert proc.exitcode == -signal.SIGKILL
        deadline = time.monotonic() + WRITER_EXIT_S
        while _writers_of(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _writers_of(proc.pid) == [], "the writer process outlived the killed training process"
        committed = checker.steps()
        model = _Blob()
        result = checker.load_latest(model)
        reported = _last_reported(report)
        assert result is not None, "a committed step exists but load_latest found none"
        step, extra = result
        assert step == committed[-1], (step, committed)
        assert step >= reported, f"step {reported} was reported committed but the newest loadable is {step}"
        assert extra == {"step": step}
        assert _is_step(model, step), f"step {step} did not load intact"
        loaded_steps.append(step)
    # a kill between a commit and its retention may leave extra old steps; the next resumed run's save sweeps them
    last = skc.CheckpointManager(root, keep_last=2, storage_options=options)
    last.load_latest(_Blob())
    last.save(loaded_steps[-1] + 1, _Blob())
    assert checker.steps() == [loaded_steps[-1], loaded_steps[-1] + 1]
    return loaded_steps


def test_sigkill_at_random_moments_never_loses_or_damages_the_newest_committed_step_local(tmp_path):
    loaded = _kill_loop(str(tmp_path / "run"), None, str(tmp_path / "report"), seed=1, delays=(0.0, 0.4))
    assert len(loaded) == KILLS and loaded == sorted(loaded) and loaded[-1] > loaded[0]


def test_sigkill_at_random_moments_never_loses_or_damages_the_newest_committed_step_s3(s3_url, tmp_path):
    root, options = s3_url
    loaded = _kill_loop(f"{root}/run", options, str(tmp_path / "report"), seed=2, delays=(0.0, 0.6), kills=6)
    assert len(loaded) == 6 and loaded == sorted(loaded) and loaded[-1] > loaded[0]


def test_sigkill_during_background_saves_through_the_writer_process_never_loses_the_newest_committed_step(tmp_path):
    # each killed job first starts its writer process (seconds on a busy machine: it imports torch), so the
    # kills (5.8, 1.1, 4.7, 1.8 s for this seed) land in start-up and in the saves after it:
    # staging, the writer's files and the commit
    loaded = _kill_loop(str(tmp_path / "run"), None, str(tmp_path / "report"), seed=15, delays=(1.0, 6.0),
                        kills=4, writer="process")
    assert len(loaded) == 4 and loaded == sorted(loaded) and loaded[-1] > loaded[0]


def test_killed_save_to_an_existing_url_leaves_the_old_checkpoint_loadable(tmp_path):
    url = str(tmp_path / "ckpt")
    model = _Blob()
    _fill(model, 1)
    skc.save({"model": model.state_dict()}, url)
    skc.load({"model": _Blob().state_dict()}, url)
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(3)
    for _ in range(5):
        def overwrite() -> None:
            m = _Blob()
            _fill(m, 2)
            while True:
                skc.save({"model": m.state_dict()}, url, chunk_bytes=64 << 10)
                _fill(m, 1)  # after the first overwrite the content is step 1 again
        proc = ctx.Process(target=overwrite)
        proc.start()
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        fresh = _Blob()
        sd = {"model": fresh.state_dict()}
        skc.load(sd, url)
        assert _is_step(fresh, 1) or _is_step(fresh, 2)


@pytest.fixture(autouse=True)
def _no_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
