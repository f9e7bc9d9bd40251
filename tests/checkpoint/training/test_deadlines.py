"""A rank that dies, freezes, fails or never calls fails every other rank within the deadline, by name.

Four gloo ranks; rank 3 is the faulty one.  Each test runs one checkpoint operation with ``timeout=10``
while rank 3 is ``SIGSTOP``ped, ``SIGKILL``ed, raises on its own, or never calls, at the moment named,
and asserts on every other rank: :class:`~shardkit.errors.CheckpointTimeout` (a ``TimeoutError``)
naming the operation, the step, the URL, the phase and rank 3, raised within the timeout + 5 s of the
fault; then that ``shardkit verify`` passes on the step committed before, that the failed step is not
committed, and that a relaunch (fresh ranks) resumes the step before, bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardkit.checkpoint as skc
from shardkit.checkpoint.training.manager import step_dir
from tests.support.dist import run_on_ranks
from tests.support.faulty_ranks import mark, marked, run_with_a_fault
from tests.support.offline_cli import run_cli

WORLD = 4
FAULTY = 3
TIMEOUT_S = 10.0
SLACK_S = 5.0  # the promise: every survivor raises within the timeout plus this
LAUNCH_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------
# on the ranks


def _model() -> nn.Module:
    """A tiny model sharded over the four ranks (every rank holds and writes its own rows)."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def _train_to(model: nn.Module, step: int) -> None:
    """The model's state at ``step``: its initial values plus 1.0, ``step`` times (the same bits on any layout)."""
    with torch.no_grad():
        for _ in range(step):
            for p in model.parameters():
                p.add_(1.0)


def _expected(step: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    with torch.no_grad():
        for _ in range(step):
            for p in plain.parameters():
                p.add_(1.0)
    return {k: v.detach().clone() for k, v in plain.state_dict().items()}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _fault(kind: str, out_dir: str) -> None:
    """Rank 3's fault, now: frozen by the scheduler, killed, or an exception of its own that ends it."""
    mark(out_dir, "fault")
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # resumed only to be killed
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"rank {FAULTY}'s own failure: only this rank raises")


def _at(target: object, name: str, kind: str, out_dir: str) -> None:
    """Make ``target.name`` fault on rank 3 when called (the moment of the fault: inside the operation)."""
    if dist.get_rank() == FAULTY:
        setattr(target, name, lambda *args, **kwargs: _fault(kind, out_dir))


def _state(model: nn.Module) -> dict[str, object]:
    return {"model": model.state_dict()}


def _save_with_fault(root: str, kind: str, out_dir: str) -> None:
    """Step 1 commits; step 2 meets rank 3's fault in its write phase (or rank 3 never calls save)."""
    from shardkit.checkpoint.formats.native.writer import NativeWriter

    model = _model()
    _train_to(model, 1)
    skc.save(_state(model), f"{root}/step-1", meta={"step": 1}, timeout=TIMEOUT_S)
    _train_to(model, 1)
    if kind == "absent":
        if dist.get_rank() == FAULTY:
            mark(out_dir, "fault")
            time.sleep(TIMEOUT_S + SLACK_S)  # busy elsewhere: never calls save
            return
    elif kind == "raise" and dist.get_rank() == FAULTY:
        _fault(kind, out_dir)  # the user's code on this rank alone raises before its save
    else:
        _at(NativeWriter, "write_file", kind, out_dir)
    skc.save(_state(model), f"{root}/step-2", meta={"step": 2}, timeout=TIMEOUT_S)


def _save_killed_inside_a_collective(root: str, out_dir: str) -> None:
    """Rank 3 arrives at a collective of step 2's save with the others, then dies inside it."""
    import shardkit.checkpoint.io.dist as dist_module

    model = _model()
    _train_to(model, 1)
    skc.save(_state(model), f"{root}/step-1", meta={"step": 1}, timeout=TIMEOUT_S)
    _train_to(model, 1)
    _at(dist_module, "framed", "kill", out_dir)  # step 2's first JSON collective: the gather of the reports
    skc.save(_state(model), f"{root}/step-2", meta={"step": 2}, timeout=TIMEOUT_S)


def _async_save_with_fault(root: str, kind: str, out_dir: str) -> None:
    from shardkit.checkpoint.formats.native.writer import NativeWriter

    model = _model()
    _train_to(model, 1)
    skc.save(_state(model), f"{root}/step-1", meta={"step": 1}, timeout=TIMEOUT_S)
    _train_to(model, 1)
    _at(NativeWriter, "write_file", kind, out_dir)  # the background write
    future = skc.async_save(_state(model), f"{root}/step-2", meta={"step": 2}, writer="thread", timeout=TIMEOUT_S)
    future.result()


def _load_with_fault(root: str, kind: str, out_dir: str) -> None:
    import shardkit.checkpoint.training.load as load_module

    model = _model()
    _train_to(model, 1)
    skc.save(_state(model), f"{root}/step-1", meta={"step": 1}, timeout=TIMEOUT_S)
    _at(load_module, "read_requests", kind, out_dir)  # in the middle of the load: after its first agreement
    skc.load(_state(_model()), f"{root}/step-1", timeout=TIMEOUT_S)


def _manager(root: str) -> skc.CheckpointManager:
    return skc.CheckpointManager(f"{root}/durable", local=f"{root}/hot/node{{node}}", local_world_size=2,
                                 replicas=1, timeout=TIMEOUT_S)


def _manager_save_with_fault(root: str, kind: str, out_dir: str) -> None:
    import shardkit.checkpoint.training.hot.replicate as hot_save

    model = _model()
    manager = _manager(root)
    _train_to(model, 1)
    manager.save(1, model)
    _train_to(model, 1)
    _at(hot_save, "write_copy", kind, out_dir)  # rank 3's own hot copy, before the replication
    manager.save(2, model)


def _load_latest_with_fault(root: str, kind: str, out_dir: str) -> None:
    import shardkit.checkpoint.training.hot.recover as recover

    model = _model()
    manager = _manager(root)
    _train_to(model, 1)
    manager.save(1, model)
    _at(recover, "hot_reports", kind, out_dir)  # the hot tier's recovery: listing this node's copies
    _manager(root).load_latest(_model())


def _save_step_2_again(root: str) -> None:
    model = _model()
    _train_to(model, 2)
    skc.save(_state(model), f"{root}/step-2", meta={"step": 2})


def _resume_bitwise(root: str, step: int, managed: bool) -> bool:
    """A relaunch: fresh ranks load the newest committed step; True where it is ``step``'s state, bitwise."""
    model = _model()
    if managed:
        found = _manager(root).load_latest(model)
        assert found is not None and found[0] == step, found
    else:
        skc.load(_state(model), f"{root}/step-{step}")
    expected, got = _expected(step), _full(model)
    return expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


# --------------------------------------------------------------------------
# in the test process


def _survivors_raised(outcomes: dict, out_dir: Path, *words: str) -> list[float]:
    """Every rank but 3 raised CheckpointTimeout with ``words`` in its message, within the timeout + 5 s of
    the fault; the seconds each took."""
    fault = marked(out_dir, "fault")
    took = []
    for rank in range(WORLD):
        if rank == FAULTY:
            continue
        outcome = outcomes[rank]
        assert outcome is not None, f"rank {rank} left no outcome: still waiting when the launch was ended"
        assert not outcome["ok"], f"rank {rank} returned instead of raising"
        assert "CheckpointTimeout" in outcome["kinds"] and "TimeoutError" in outcome["kinds"], outcome["traceback"]
        took.append(outcome["at"] - fault)
        print(f"rank {rank} raised {outcome['type']} {took[-1]:.2f} s after the fault: {outcome['message']}")
        for word in words:
            assert word in outcome["message"], (word, outcome["message"])
        assert took[-1] <= TIMEOUT_S + SLACK_S, (rank, took[-1])
    return took


def _previous_step_intact(url: str) -> None:
    result = run_cli("verify", url)
    assert result.exit_code == 0, result.stdout + result.stderr


def _nothing_lost(root: str, failed: Path | None, previous: str, hot: bool = False) -> None:
    """The failed step was not committed (``failed``, when the fault struck a save), ``shardkit verify`` passes
    on the step before, and fresh ranks resume that step bitwise."""
    if failed is not None:
        assert not (failed / "manifest.json").exists()
    _previous_step_intact(previous)
    assert run_on_ranks(WORLD, _resume_bitwise, root, 1, hot) == [True] * WORLD


@pytest.mark.parametrize("kind", ["stop", "kill", "raise", "absent"])
def test_a_blocking_save_fails_every_other_rank_within_the_deadline(tmp_path: Path, kind: str) -> None:
    root, out = str(tmp_path / "ckpt"), tmp_path / "outcomes"
    outcomes = run_with_a_fault(WORLD, _save_with_fault, root, kind, str(out), out_dir=out, timeout=LAUNCH_TIMEOUT_S,
                                faulty=FAULTY)
    phase = "'plan'" if kind in ("raise", "absent") else "'write'"
    took = _survivors_raised(outcomes, out, f"save of step 2 to {root}/step-2", f"rank {FAULTY} did not arrive",
                             phase, "within 10 s", "nothing was committed")
    assert min(took) >= TIMEOUT_S - 1.0 or kind == "raise"  # they waited for the deadline, not less
    _nothing_lost(root, Path(root) / "step-2", f"{root}/step-1")
    if kind == "kill":  # the files the failed step's ranks wrote are removed by the next save there
        step2 = Path(root) / "step-2"
        assert _files(step2), "the failed save wrote nothing: the fault came too early to leave temp files"
        run_on_ranks(WORLD, _save_step_2_again, root)
        assert _files(step2) == set(json.loads((step2 / "manifest.json").read_text())["files"])
        assert run_on_ranks(WORLD, _resume_bitwise, root, 2, False) == [True] * WORLD


def _files(step: Path) -> set[str]:
    return {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file() and p.name != "manifest.json"}


def test_a_rank_killed_inside_a_collective_fails_the_others_with_peer_lost_naming_it(tmp_path: Path) -> None:
    root, out = str(tmp_path / "ckpt"), tmp_path / "outcomes"
    outcomes = run_with_a_fault(WORLD, _save_killed_inside_a_collective, root, str(out), out_dir=out,
                                timeout=LAUNCH_TIMEOUT_S, faulty=FAULTY)
    fault = marked(out, "fault")
    for rank in range(WORLD - 1):
        outcome = outcomes[rank]
        assert outcome is not None and not outcome["ok"], f"rank {rank} did not raise"
        print(f"rank {rank} raised {outcome['type']} {outcome['at'] - fault:.2f} s after the fault: "
              f"{outcome['message']}")
        assert "PeerLost" in outcome["kinds"] and "ConnectionError" in outcome["kinds"], outcome["traceback"]
        for word in (f"save of step 2 to {root}/step-2", f"rank {FAULTY} left the collective", "nothing was committed"):
            assert word in outcome["message"], (word, outcome["message"])
        assert outcome["at"] - fault <= TIMEOUT_S + SLACK_S
    _nothing_lost(root, Path(root) / "step-2", f"{root}/step-1")


def test_an_async_saves_background_write_fails_every_other_rank_within_the_deadline(tmp_path: Path) -> None:
    root, out = str(tmp_path / "ckpt"), tmp_path / "outcomes"
    outcomes = run_with_a_fault(WORLD, _async_save_with_fault, root, "kill", str(out), out_dir=out,
                                timeout=LAUNCH_TIMEOUT_S, faulty=FAULTY)
    _survivors_raised(outcomes, out, f"async save of step 2 to {root}/step-2", f"rank {FAULTY} did not arrive",
                      "'write'", "nothing was committed")
    _nothing_lost(root, Path(root) / "step-2", f"{root}/step-1")


def test_a_load_fails_every_other_rank_within_the_deadline_when_a_rank_freezes(tmp_path: Path) -> None:
    root, out = str(tmp_path / "ckpt"), tmp_path / "outcomes"
    outcomes = run_with_a_fault(WORLD, _load_with_fault, root, "stop", str(out), out_dir=out,
                                timeout=LAUNCH_TIMEOUT_S, faulty=FAULTY)
    _survivors_raised(outcomes, out, f"load from {root}/step-1", f"rank {FAULTY} did not arrive", "'read'",
                      "within 10 s")
    _nothing_lost(root, None, f"{root}/step-1")


def test_a_manager_save_with_the_hot_tier_fails_every_other_rank_within_the_deadline(tmp_path: Path) -> None:
    root, out = str(tmp_path / "ckpt"), tmp_path / "outcomes"
    outcomes = run_with_a_fault(WORLD, _manager_save_with_fault, root, "stop", str(out), out_dir=out,
                                timeout=LAUNCH_TIMEOUT_S, faulty=FAULTY)
    _survivors_raised(outcomes, out, "save of step 2 to ", step_dir(2), f"rank {FAULTY} did not arrive",
                      "'replicate'", "nothing was committed")
    _nothing_lost(root, Path(root) / "durable" / step_dir(2), f"{root}/durable/{step_dir(1)}", hot=True)


def test_load_latest_fails_every_other_rank_within_the_deadline_when_a_rank_freezes(tmp_path: Path) -> None:
    root, out = str(tmp_path / "ckpt"), tmp_path / "outcomes"
    outcomes = run_with_a_fault(WORLD, _load_latest_with_fault, root, "stop", str(out), out_dir=out,
                                timeout=LAUNCH_TIMEOUT_S, faulty=FAULTY)
    _survivors_raised(outcomes, out, "load from ", "durable", f"rank {FAULTY} did not arrive", "'vote'")
    _nothing_lost(root, None, f"{root}/durable/{step_dir(1)}", hot=True)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "10", True])
def test_a_timeout_that_cannot_be_a_deadline_is_refused_naming_the_option(tmp_path: Path, bad: object) -> None:
    from shardkit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="timeout"):
        skc.save({"x": torch.zeros(2)}, str(tmp_path / "a"), timeout=bad)
    with pytest.raises(ConfigurationError, match="timeout"):
        skc.async_save({"x": torch.zeros(2)}, str(tmp_path / "b"), writer="thread", timeout=bad)
    with pytest.raises(ConfigurationError, match="timeout"):
        skc.load({"x": torch.zeros(2)}, str(tmp_path / "c"), timeout=bad)
    with pytest.raises(ConfigurationError, match="timeout"):
        skc.CheckpointManager(str(tmp_path / "m"), timeout=bad)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before anything is written


def test_the_environment_sets_the_default_deadline_job_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import timedelta

    from shardkit.checkpoint.io.deadline import DEFAULT_TIMEOUT_S, current_deadline, deadline_for

    assert current_deadline().timeout_s == DEFAULT_TIMEOUT_S == 600.0
    monkeypatch.setenv("SHARDKIT_CHECKPOINT_TIMEOUT", "42")
    assert current_deadline().timeout_s == 42.0
    assert deadline_for("save", "x", timedelta(minutes=2)).timeout_s == 120.0
    monkeypatch.setenv("SHARDKIT_CHECKPOINT_TIMEOUT", "soon")
    from shardkit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="SHARDKIT_CHECKPOINT_TIMEOUT"):
        current_deadline()
