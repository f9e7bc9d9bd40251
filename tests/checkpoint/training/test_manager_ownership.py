"""A manager saves over no step it did not write itself: an earlier run's steps survive a new run that failed
to resume from them, and ``dedup`` references only steps this manager committed or resumed from."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.errors import CheckpointExists, ShardkitError
from tests.checkpoint.training.test_dedup import CHUNK, FineTune, at_step, loaded, manifest_of, same, step_path
from tests.support.dist import run_on_ranks


def earlier_run(root: Path, steps=(1, 2, 3, 4, 5), **options) -> None:
    manager = skc.CheckpointManager(str(root), dedup=True, chunk_bytes=CHUNK, **options)
    model = FineTune()
    for step in steps:
        manager.save(step, at_step(model, step), rng=False)
    manager.wait()


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_new_run_after_a_failed_resume_refuses_to_save_over_the_earlier_steps(tmp_path, caplog):
    earlier_run(tmp_path)
    shutil.rmtree(step_path(tmp_path, 1))  # the dedup base, deleted by hand: steps 2-5 no longer load
    before = snapshot(tmp_path)
    manager = skc.CheckpointManager(str(tmp_path), dedup=True, chunk_bytes=CHUNK)
    with caplog.at_level(logging.WARNING):
        assert manager.load_latest(FineTune(), rng=False) is None
    assert "without overwrite=True" in caplog.text
    with pytest.raises(CheckpointExists) as refused:
        manager.save(1, at_step(FineTune(), 1), rng=False)
    message = str(refused.value)
    assert "step(s) 2, 3, 4, 5" in message and str(tmp_path) in message
    assert "required=True" in message and "another root" in message and "overwrite=True" in message
    assert snapshot(tmp_path) == before  # nothing written, nothing removed
    assert manager.steps() == [2, 3, 4, 5]


def test_a_fresh_manager_refuses_to_replace_a_committed_step_and_may_save_above_it(tmp_path):
    earlier_run(tmp_path, steps=(1, 2))
    first = manifest_of(step_path(tmp_path, 2))
    manager = skc.CheckpointManager(str(tmp_path))
    with pytest.raises(CheckpointExists, match=r"step\(s\) 2 there"):
        manager.save(2, at_step(FineTune(), 9), rng=False)
    assert manifest_of(step_path(tmp_path, 2)) == first
    manager.save(3, at_step(FineTune(), 3), rng=False)
    manager.save(3, at_step(FineTune(), 33), rng=False)  # its own step: replaced as asked
    assert manager.steps() == [1, 2, 3] and same(loaded(manager.url_of(3)), at_step(FineTune(), 33))


@pytest.mark.parametrize("how", ["load_latest", "load"])
def test_a_resumed_manager_may_save_its_resumed_step_again_and_continue(tmp_path, how):
    earlier_run(tmp_path, steps=(1, 2, 3))
    manager = skc.CheckpointManager(str(tmp_path), dedup=True, chunk_bytes=CHUNK)
    model = FineTune()
    if how == "load_latest":
        assert manager.load_latest(model, rng=False)[0] == 3
    else:
        manager.load(3, model, rng=False)
    manager.save(3, at_step(model, 3), rng=False)
    manager.save(4, at_step(model, 4), rng=False)
    assert manager.steps() == [1, 2, 3, 4]
    assert same(loaded(manager.url_of(4)), at_step(FineTune(), 4))


def test_a_manager_that_resumed_from_an_older_step_refuses_the_newer_ones_it_skipped(tmp_path):
    earlier_run(tmp_path, steps=(1, 2, 3))
    shutil.rmtree(step_path(tmp_path, 3) / "data")  # step 3 is damaged: load_latest falls back to step 2
    manager = skc.CheckpointManager(str(tmp_path), dedup=True, chunk_bytes=CHUNK)
    assert manager.load_latest(FineTune(), rng=False)[0] == 2
    with pytest.raises(CheckpointExists, match=r"step\(s\) 3 there"):
        manager.save(3, at_step(FineTune(), 3), rng=False)


def test_overwrite_replaces_the_earlier_steps_and_removes_those_above_once_its_step_committed(tmp_path):
    earlier_run(tmp_path)
    shutil.rmtree(step_path(tmp_path, 1))
    manager = skc.CheckpointManager(str(tmp_path), dedup=True, chunk_bytes=CHUNK, overwrite=True)
    assert manager.load_latest(FineTune(), rng=False) is None
    manager.save(1, at_step(FineTune(), 11), rng=False)
    assert manager.steps() == [1]  # 2-5 were superseded by this run's step 1 and removed after it committed
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_path(tmp_path, 1).name]
    resumed = FineTune()
    assert manager.load_latest(resumed, rng=False)[0] == 1 and same(resumed, at_step(FineTune(), 11))


def test_dedup_never_references_a_step_this_manager_did_not_commit_or_resume_from(tmp_path):
    earlier_run(tmp_path, steps=(1, 2, 3))
    stranger = skc.CheckpointManager(str(tmp_path), dedup=True, chunk_bytes=CHUNK)
    stranger.save(10, at_step(FineTune(), 10), rng=False)  # no resume: step 3 is the highest, not its base
    assert "references" not in manifest_of(step_path(tmp_path, 10))
    stranger.save(11, at_step(FineTune(), 11), rng=False)
    assert manifest_of(step_path(tmp_path, 11))["references"] == [step_path(tmp_path, 10).name]

    resumed = skc.CheckpointManager(str(tmp_path), dedup=True, chunk_bytes=CHUNK)
    model = FineTune()
    resumed.load(3, model, rng=False)
    with pytest.raises(CheckpointExists):  # 10 and 11 are above: a resume would choose them over step 4
        resumed.save(4, at_step(model, 4), rng=False)


def test_an_async_manager_refuses_at_the_call_and_keeps_the_step(tmp_path):
    earlier_run(tmp_path, steps=(1,))
    before = snapshot(tmp_path)
    manager = skc.CheckpointManager(str(tmp_path), async_save=True)
    with pytest.raises(CheckpointExists):
        manager.save(1, at_step(FineTune(), 7), rng=False)
    manager.wait()
    assert snapshot(tmp_path) == before


def _what_saving_step_one_raises(manager: skc.CheckpointManager) -> str:
    """On this rank: the name of the shardkit error saving step 1 raised, or "saved"."""
    try:
        manager.save(1, at_step(FineTune(), 5), rng=False)
    except ShardkitError as exc:
        return type(exc).__name__
    return "saved"


def _refused_on_every_rank(root: str) -> str:
    return _what_saving_step_one_raises(skc.CheckpointManager(root))


def test_every_rank_refuses_together(tmp_path):
    earlier_run(tmp_path, steps=(1,))
    before = json.dumps(manifest_of(step_path(tmp_path, 1)), sort_keys=True)
    assert run_on_ranks(2, _refused_on_every_rank, str(tmp_path)) == ["CheckpointExists"] * 2
    assert json.dumps(manifest_of(step_path(tmp_path, 1)), sort_keys=True) == before
    assert torch.equal(loaded(str(step_path(tmp_path, 1))).head.weight, at_step(FineTune(), 1).head.weight)


def test_retention_never_deletes_an_earlier_runs_steps_this_manager_did_not_resume(tmp_path, caplog):
    earlier_run(tmp_path, steps=(10, 20, 30))
    stranger = skc.CheckpointManager(str(tmp_path), keep_last=1)
    with caplog.at_level(logging.WARNING):
        stranger.save(40, at_step(FineTune(), 40), rng=False)
        stranger.save(50, at_step(FineTune(), 50), rng=False)
    assert stranger.steps() == [10, 20, 30, 50]  # its own 40 went; the earlier run's stay
    assert "retention leaves steps 10, 20, 30" in caplog.text
    resumed = skc.CheckpointManager(str(tmp_path), keep_last=1)
    assert resumed.load_latest(FineTune(), rng=False)[0] == 50
    resumed.save(60, at_step(FineTune(), 60), rng=False)  # the history below a resumed step is its run's
    assert resumed.steps() == [60]


def test_a_kill_after_an_overwrite_commit_never_resumes_the_steps_it_superseded(tmp_path, monkeypatch):
    earlier_run(tmp_path, steps=(1, 2, 3))
    manager = skc.CheckpointManager(str(tmp_path), overwrite=True)
    monkeypatch.setattr(manager.durable, "committed", lambda plan, pending: None)  # killed right after the commit
    manager.save(1, at_step(FineTune(), 11), rng=False)
    assert manager.steps() == [1, 2, 3]
    model = FineTune()
    assert skc.CheckpointManager(str(tmp_path)).load_latest(model, rng=False)[0] == 1
    assert same(model, at_step(FineTune(), 11))
    later = skc.CheckpointManager(str(tmp_path), keep_last=5)
    later.load_latest(FineTune(), rng=False)
    later.save(2, at_step(FineTune(), 12), rng=False)  # not in its way: step 2 is superseded; retention removes 3
    assert later.steps() == [1, 2] and not (tmp_path / "superseded.json").exists()


def test_an_overwrite_save_killed_before_its_commit_leaves_the_earlier_run_resumable(tmp_path, monkeypatch):
    earlier_run(tmp_path, steps=(1, 2, 3))
    manager = skc.CheckpointManager(str(tmp_path), overwrite=True)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("shardkit.checkpoint.training.durable_tier.save", killed)
    with pytest.raises(KeyboardInterrupt):
        manager.save(1, at_step(FineTune(), 11), rng=False)
    model = FineTune()
    assert skc.CheckpointManager(str(tmp_path)).load_latest(model, rng=False)[0] == 3
    assert same(model, at_step(FineTune(), 3))


def test_a_step_another_job_commits_between_the_check_and_the_commit_is_refused_not_replaced(tmp_path,
                                                                                             monkeypatch):
    import shardkit.checkpoint.training.manager as manager_module

    manager = skc.CheckpointManager(str(tmp_path))
    real = manager_module.data_state_dict

    def other_job_commits_first(*args, **kwargs):
        skc.save({"model": at_step(FineTune(), 99).state_dict()}, manager.url_of(3))
        return real(*args, **kwargs)
    monkeypatch.setattr(manager_module, "data_state_dict", other_job_commits_first)
    with pytest.raises(CheckpointExists):
        manager.save(3, at_step(FineTune(), 3), rng=False)
    assert same(loaded(manager.url_of(3)), at_step(FineTune(), 99))


def test_the_refusal_says_what_saving_would_do_to_the_steps_in_the_way(tmp_path):
    earlier_run(tmp_path, steps=(20, 30))
    with pytest.raises(CheckpointExists) as refused:
        skc.CheckpointManager(str(tmp_path)).save(10, at_step(FineTune(), 10), rng=False)
    message = str(refused.value)
    assert "step(s) 20, 30 there" in message and "leave them above this run's step" in message
    assert "replace step 10" not in message


def _rank_zero_cannot_list(root: str) -> str:
    import torch.distributed as dist

    from shardkit.errors import StorageError

    manager = skc.CheckpointManager(root)
    if dist.get_rank() == 0:
        def unreachable():
            raise StorageError(f"listing {root} failed after 4 attempts")
        manager.durable.step_dirs = unreachable
    return _what_saving_step_one_raises(manager)


def test_a_failure_on_rank_zero_while_planning_a_save_fails_every_rank_at_once(tmp_path):
    assert run_on_ranks(2, _rank_zero_cannot_list, str(tmp_path), timeout=60) == ["StorageError"] * 2
