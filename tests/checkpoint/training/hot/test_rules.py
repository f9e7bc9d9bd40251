"""The hot tier's rules in one process: retention, damaged and partial copies, space, options."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.checkpoint.training.hot.local_keep import check_space
from shardkit.checkpoint.training.hot.nodes import NodeLayout
from shardkit.data import Stateful
from shardkit.errors import ConfigurationError, DataStateError
from tests.support.checkpoint_helpers import stepped_linear


def _manager(root, **options) -> skc.CheckpointManager:
    options = {"local": str(root / "hot" / "node{node}"), "local_keep": 2, "replicas": 0, "durable_every": 5,
               **options}
    return skc.CheckpointManager(str(root / "durable"), **options)


def _save_steps(root, steps, **options) -> None:
    manager = _manager(root, **options)
    for step in steps:
        manager.save(step, stepped_linear(step), extra={"step": step})
    manager.wait()


def _resume(root, **options) -> tuple[int, str, float]:
    """Resume a fresh model; check it holds the recovered step's values; (step, source, seconds)."""
    manager = _manager(root, **options)
    model = stepped_linear(-1)
    step, extra = manager.load_latest(model, required=True)
    assert extra == {"step": step}
    assert torch.equal(model.weight, torch.full((8, 16), float(step)))
    assert torch.equal(model.bias, torch.full((8,), -float(step)))
    return step, manager.last_load.source, manager.last_load.seconds


def _run_dir(root):
    """This run's directory on node 0 (``<local>/run-<digest of the durable root>``)."""
    [run] = os.listdir(root / "hot" / "node0")
    return root / "hot" / "node0" / run


def _step_dir(root, step: int) -> str:
    return str(_run_dir(root) / f"step-{step:010d}")


def _copy_of_rank0(root, step: int) -> str:
    [name] = [n for n in os.listdir(_step_dir(root, step)) if n.startswith("rank-0.")]
    return os.path.join(_step_dir(root, step), name)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_single_process_run_resumes_from_its_own_newest_local_copy(tmp_path, async_save):
    _save_steps(tmp_path, range(1, 8), async_save=async_save)
    assert _resume(tmp_path)[:2] == (7, "local")
    assert skc.CheckpointManager(str(tmp_path / "durable")).steps() == [5]


def test_retention_keeps_local_keep_complete_steps_and_never_a_file_it_did_not_write(tmp_path, caplog):
    _save_steps(tmp_path, range(1, 4))
    node = _run_dir(tmp_path)
    (node / "notes.txt").write_text("mine")
    (node / "step-0000000002" / "mine.txt").write_text("mine too")
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        _save_steps(tmp_path, range(4, 7))
    assert sorted(os.listdir(node)) == ["notes.txt", "root.json", "step-0000000002", "step-0000000005",
                                    "step-0000000006"]
    assert os.listdir(node / "step-0000000002") == ["mine.txt"]
    assert "mine.txt" in caplog.text


def test_a_damaged_newest_copy_falls_back_to_the_older_complete_local_step(tmp_path, caplog):
    _save_steps(tmp_path, range(1, 5))
    with open(os.path.join(_copy_of_rank0(tmp_path, 4), "state.bin"), "r+b") as f:
        first = f.read(3)  # the first tensor's first bytes
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in first))
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        assert _resume(tmp_path)[:2] == (3, "local")
    assert "step-0000000004" in caplog.text and "checksum" in caplog.text.lower()


def test_a_step_killed_before_its_copy_committed_is_never_chosen(tmp_path):
    _save_steps(tmp_path, range(1, 4))
    partial = os.path.join(_step_dir(tmp_path, 9), os.path.basename(_copy_of_rank0(tmp_path, 3)))
    shutil.copytree(_copy_of_rank0(tmp_path, 3), partial)
    os.unlink(os.path.join(partial, "manifest.json"))  # data written, the commit never happened
    assert _resume(tmp_path)[:2] == (3, "local")


def test_the_durable_root_wins_when_it_holds_a_newer_step_than_the_hot_tier(tmp_path):
    _save_steps(tmp_path, range(1, 6))
    shutil.rmtree(_step_dir(tmp_path, 5))  # the hot tier's newest is now step 4, the durable root's step 5
    assert _resume(tmp_path)[:2] == (5, "durable")


def test_a_directory_that_cannot_hold_local_keep_steps_is_refused_up_front(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ConfigurationError, match=r"cannot hold local_keep=2 steps.*lower local_keep"):
        check_space(str(tmp_path / "node0"), free // 2, local_keep=2)
    check_space(str(tmp_path / "node1"), 1 << 20, local_keep=2)


@pytest.mark.parametrize("options, message", [
    ({"replicas": 2}, "pass local="),
    ({"durable_every": 0}, "durable_every must be a positive integer"),
    ({"local": "s3://bucket/hot", "replicas": 0}, "node-local filesystem"),
    ({"local": "/tmp/hot", "local_keep": 0}, "local_keep must be a positive integer"),
], ids=["replicas_without_local", "durable_every_zero", "url", "local_keep_zero"])
def test_options_the_hot_tier_cannot_honour_are_refused(tmp_path, options, message):
    with pytest.raises(ConfigurationError, match=message):
        skc.CheckpointManager(str(tmp_path / "durable"), **options)


def test_node_arithmetic_refuses_ranks_per_node_that_do_not_divide_the_world_and_clamps_replicas(caplog):
    with pytest.raises(ConfigurationError, match="must be a positive integer dividing the world size 6"):
        NodeLayout.of("/tmp/n{node}", 6, 4, 1)
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        layout = NodeLayout.of("/tmp/n{node}", 4, 2, 3, "s3://bucket/run-7")
    assert layout.replicas == 1 and "keeping 1 replica" in caplog.text
    assert [layout.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert layout.replica_holders(1) == [3] and layout.replicated_here(1) == [3]
    assert layout.node_dir(3) == "/tmp/n1/run-" + hashlib.sha256(b"s3://bucket/run-7").hexdigest()[:12]


def test_a_run_resumed_below_the_hot_tiers_newest_step_removes_that_abandoned_history_at_its_next_save(tmp_path):
    _save_steps(tmp_path, range(1, 8))  # hot 6 and 7, durable 5
    rerun = _manager(tmp_path)
    rerun.load(5, stepped_linear(-1))  # the user chose step 5: steps 6 and 7 are another history now
    rerun.save(6, stepped_linear(6), extra={"step": 6})
    assert sorted(os.listdir(_run_dir(tmp_path))) == ["root.json", "step-0000000006"]
    assert _resume(tmp_path)[:2] == (6, "local")


class _Leftover:
    """Input state whose tensor changes size from step to step (a packing loader's carried-over tokens)."""

    def __init__(self, tokens) -> None:
        self.tokens = torch.as_tensor(tokens, dtype=torch.float32)

    def state_dict(self) -> dict:
        return {"tokens": self.tokens.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.tokens = state["tokens"].clone()


def test_input_state_that_changes_size_between_background_saves_is_saved_as_it_was(tmp_path):
    manager = _manager(tmp_path, async_save=True)
    for step, tokens in ((1, [1.0, 2.0, 3.0, 4.0]), (2, [7.0]), (3, [5.0, 6.0])):
        manager.save(step, stepped_linear(step), extra={"step": step}, stateful={"loader": Stateful(_Leftover(tokens))})
    manager.wait()
    resumed = _Leftover([])
    model = stepped_linear(-1)
    assert _manager(tmp_path).load_latest(model, stateful={"loader": Stateful(resumed)}) == (3, {"step": 3})
    assert torch.equal(resumed.tokens, torch.tensor([5.0, 6.0]))


def test_a_sampler_or_object_the_copy_lacks_is_refused_and_the_hot_steps_stay(tmp_path):
    _save_steps(tmp_path, range(1, 4))
    before = sorted(os.listdir(_run_dir(tmp_path)))
    with pytest.raises(DataStateError, match="loader"):
        _manager(tmp_path).load_latest(stepped_linear(-1), stateful={"loader": Stateful(_Leftover([]))})
    assert sorted(os.listdir(_run_dir(tmp_path))) == before


def test_two_runs_sharing_a_local_directory_never_read_or_remove_each_others_copies(tmp_path):
    _save_steps(tmp_path / "a", range(1, 4), local=str(tmp_path / "shared" / "node{node}"))
    other = skc.CheckpointManager(str(tmp_path / "b" / "durable"), local=str(tmp_path / "shared" / "node{node}"),
                                  replicas=0)
    assert other.load_latest(stepped_linear(-1)) is None
    other.save(1, stepped_linear(100))
    mine = _manager(tmp_path / "a", local=str(tmp_path / "shared" / "node{node}"))
    model = stepped_linear(-1)
    assert mine.load_latest(model) == (3, {"step": 3}) and mine.last_load.source == "local"
    assert torch.equal(model.weight, torch.full((8, 16), 3.0))
