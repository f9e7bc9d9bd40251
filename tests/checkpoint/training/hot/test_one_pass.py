"""The hot tier's short paths keep their guarantees.

* A save to the hot tier alone takes the RNG state on the training thread, at the call, and gathers it over
  the ranks in its background part (one collective the training thread no longer waits for).
* A recovery from the local tier reads each rank's own copy straight into its targets, checking every
  piece as it lands: a damaged byte found there sends the recovery on to the replica on the other node;
  when no step is left whole, the resume raises rather than report nothing to resume over a model it wrote
  in part.

2 gloo ranks play 2 nodes of 1 (``local_world_size=1``, ``replicas=1``); each rank's weights say which
step and rank saved them.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import shardkit.checkpoint as skc
import shardkit.data.resume as resume
from shardkit.checkpoint.training.hot.flat import entries_of, read_manifest
from shardkit.errors import CorruptCheckpoint, DataStateError
from tests.support.checkpoint_helpers import stepped_linear
from tests.support.dist import RankFailure, run_on_ranks


def _manager(root: str, **options) -> skc.CheckpointManager:
    options = {"local": os.path.join(root, "hot", "node{node}"), "local_world_size": 1, "replicas": 1,
               "local_keep": 2, "durable_every": 100, **options}
    return skc.CheckpointManager(os.path.join(root, "durable"), **options)


def _value(step: int, rank: int) -> int:
    return 10 * step + rank


def _save(root: str, steps: list[int], local_keep: int = 2) -> None:
    import torch.distributed as dist

    manager = _manager(root, local_keep=local_keep)
    for step in steps:
        manager.save(step, stepped_linear(_value(step, dist.get_rank())), extra={"step": step})
    manager.wait()


def _resume(root: str) -> tuple:
    """(step, source, the weight's value) on this rank, or the error's class name and whether the weight
    still holds its value from before the resume."""
    import torch.distributed as dist

    model = stepped_linear(-1)
    manager = _manager(root)
    try:
        step, _ = manager.load_latest(model, required=True)
    except CorruptCheckpoint as exc:
        return type(exc).__name__, bool(torch.equal(model.weight, torch.full((8, 16), -1.0))), str(exc)
    assert torch.equal(model.bias, -model.weight[:, 0])
    return step, manager.last_load.source, float(model.weight[0, 0]), dist.get_rank()


def _own_copies(root: str, node: int) -> list[str]:
    """The data files of node ``node``'s rank's own copies (its rank's copies: ``rank-<node>.*``)."""
    node_dir = os.path.join(root, "hot", f"node{node}")
    return sorted(os.path.join(d, "state.bin") for d, _, names in os.walk(node_dir)
                  if os.path.basename(d).startswith(f"rank-{node}.") and "state.bin" in names)


def _every_copy_of_rank(root: str, rank: int) -> list[str]:
    return sorted(os.path.join(d, "state.bin") for d, _, names in os.walk(os.path.join(root, "hot"))
                  if os.path.basename(d).split(".")[0] in (f"rank-{rank}", f"replica-{rank}") and "state.bin" in names)


def _flip_a_weight_byte(path: str) -> None:
    """Damage the model's weight in the data file, not the manifest nor the input state: the copy checks
    out before the vote and is found bad only while its weight is read into the target."""
    copy = os.path.dirname(path)
    [weight] = [e for e in entries_of(read_manifest(copy), copy) if e.key == "model.weight"]
    with open(path, "r+b") as f:
        f.seek(weight.offset + weight.nbytes // 2)
        byte = f.read(1)
        f.seek(weight.offset + weight.nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_byte_damaged_in_a_ranks_own_copy_is_found_while_read_into_the_targets_and_the_replica_is_used(tmp_path):
    root = str(tmp_path)
    run_on_ranks(2, _save, root, [1, 2])
    newest = _own_copies(root, 0)[-1]
    assert "step-0000000002" in newest
    _flip_a_weight_byte(newest)
    got = run_on_ranks(2, _resume, root)
    # rank 1 read its own copy into its targets, rank 0 found the damage while reading its own: both go on
    # to step 2 assembled with rank 0's replica from node 1, and hold exactly step 2's state
    assert got == [(2, "peer", float(_value(2, 0)), 0), (2, "peer", float(_value(2, 1)), 1)]


def test_a_copy_found_damaged_after_it_wrote_targets_with_no_step_left_whole_raises_on_every_rank(tmp_path):
    root = str(tmp_path)
    run_on_ranks(2, _save, root, [1, 2], local_keep=1)  # one hot step kept, no durable step
    damaged = _every_copy_of_rank(root, 0)
    assert len(damaged) == 2  # rank 0's own copy of step 2 and its replica on node 1
    for path in damaged:
        _flip_a_weight_byte(path)
    got = run_on_ranks(2, _resume, root)
    # rank 1's targets hold step 2's weights already (its copy was sound): not "nothing to resume"
    assert [g[:2] for g in got] == [("CorruptCheckpoint", False), ("CorruptCheckpoint", False)]
    assert all("neither as it was nor any saved step" in g[2] for g in got)


def test_a_hot_save_takes_the_rng_state_at_its_call_and_gathers_it_off_the_training_thread(tmp_path, monkeypatch):
    gathered_on = []
    gather = resume.all_gather_trees

    def recording(*args, **kwargs):
        gathered_on.append(threading.current_thread() is threading.main_thread())
        return gather(*args, **kwargs)

    monkeypatch.setattr(resume, "all_gather_trees", recording)
    manager = _manager(str(tmp_path), async_save=True, replicas=0)
    torch.manual_seed(5)
    manager.save(1, stepped_linear(1))
    drawn = torch.rand(4)  # training goes on at once: draws from the generator the save took
    manager.wait()
    assert gathered_on == [False]
    torch.manual_seed(123)
    assert _manager(str(tmp_path), replicas=0).load_latest(stepped_linear(-1)) == (1, None)
    assert torch.equal(torch.rand(4), drawn)  # the state of the call, not of the moment it was gathered


def _save_with_rng(root: str) -> str:
    import torch.distributed as dist

    manager = _manager(root)
    try:
        manager.save(1, stepped_linear(1), rng=dist.get_rank() == 0)
    except DataStateError as exc:
        return str(exc)
    return "saved"


def test_ranks_that_pass_different_rng_flags_to_a_hot_save_fail_it_on_every_rank(tmp_path):
    got = run_on_ranks(2, _save_with_rng, str(tmp_path))
    assert all(g.startswith("CheckpointManager.save was called with other arguments on rank") and
               g.endswith("and the same rng flag") for g in got)


def test_a_rank_0_listing_failure_is_raised_on_every_rank(tmp_path):
    run_on_ranks(2, _save, str(tmp_path), [1])
    with pytest.raises(RankFailure, match="listing broke"):
        run_on_ranks(2, _resume_with_a_broken_listing, str(tmp_path))


def _resume_with_a_broken_listing(root: str) -> None:
    from shardkit.checkpoint.training.durable_tier import DurableTier

    def broken(self, dcp: bool = False):
        raise OSError("listing broke")

    original, DurableTier.resumable_steps = DurableTier.resumable_steps, broken
    try:
        _manager(root).load_latest(stepped_linear(-1))
    finally:
        DurableTier.resumable_steps = original
