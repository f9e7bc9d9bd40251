"""Recovery that cannot be missed: the hot tier finds its copies however the durable root is spelled, adopts
what an earlier shardkit filed under the root as typed, names other roots' copies in one WARNING, and a
torchrun restart that would hang in ``init_process_group`` fails in seconds naming the fix."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.checkpoint.io.location import canonical_url
from shardkit.checkpoint.training.hot.nodes import NodeLayout
from shardkit.checkpoint.training.restarts import restart_hazard
from tests.support.checkpoint_helpers import stepped_linear
from tests.support.dist import run_on_ranks, run_torchrun

RESTART_SCRIPT = Path(__file__).resolve().parents[3] / "support" / "hot_restart_run.py"


def _manager(root_url: str, local: str) -> skc.CheckpointManager:
    return skc.CheckpointManager(root_url, local=local, replicas=0, local_keep=2, durable_every=5)


def _save_steps(root_url: str, local: str, steps) -> None:
    manager = _manager(root_url, local)
    for step in steps:
        manager.save(step, stepped_linear(step), extra={"step": step})
    manager.wait()


def _resume(root_url: str, local: str) -> tuple[int, str]:
    manager = _manager(root_url, local)
    model = stepped_linear(-1)
    step, extra = manager.load_latest(model, required=True)
    assert extra == {"step": step}
    assert torch.equal(model.weight, torch.full((8, 16), float(step)))
    return step, manager.last_load.source


def _run_key(url: str) -> str:
    return NodeLayout.of("/tmp/n{node}", 1, 1, 0, url).run


def test_every_spelling_of_one_local_root_gives_one_run_directory(tmp_path, monkeypatch):
    real = tmp_path / "ckpt"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.chdir(tmp_path)
    spellings = [str(real), f"{real}/", f"file://{real}", f"file://{real}/", "./ckpt", "ckpt", "ckpt/",
                 str(tmp_path / "link"), "./link/", f"{tmp_path}/./sub/../ckpt"]
    assert {canonical_url(s) for s in spellings} == {f"file://{os.path.realpath(real)}"}
    assert {_run_key(s) for s in spellings} == {
        "run-" + hashlib.sha256(f"file://{os.path.realpath(real)}".encode()).hexdigest()[:12]}
    assert _run_key(str(tmp_path / "other")) != _run_key(str(real))


def test_an_object_store_root_with_or_without_a_trailing_slash_is_one_root():
    assert canonical_url("s3://b/x/") == canonical_url("s3://b/x") == "s3://b/x"
    assert _run_key("s3://b/x/") == _run_key("s3://b/x") == _run_key("s3a://b/x")
    assert _run_key("s3://b/x") != _run_key("s3://b/y")
    assert _run_key("s3://b/x") != _run_key("gs://b/x")


def test_a_restart_that_spells_the_root_another_way_resumes_from_the_hot_copies(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = str(tmp_path / "hot" / "node{node}")
    _save_steps("./durable", local, range(1, 8))  # hot 6 and 7, durable 5
    assert _resume(f"{tmp_path}/durable/", local) == (7, "local")
    assert _resume(f"file://{tmp_path}/durable", local) == (7, "local")
    [run] = os.listdir(tmp_path / "hot" / "node0")
    with open(tmp_path / "hot" / "node0" / run / "root.json") as f:
        assert json.load(f) == {"root": f"file://{os.path.realpath(tmp_path / 'durable')}"}


def test_copies_an_earlier_version_filed_under_the_root_as_typed_are_adopted(tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "hot" / "node{node}")
    _save_steps(root, local, range(1, 4))
    node = tmp_path / "hot" / "node0"
    [run] = os.listdir(node)
    os.remove(node / run / "root.json")  # as an earlier shardkit left it: keyed by the URL as typed, no record
    legacy = "run-" + hashlib.sha256(root.encode()).hexdigest()[:12]
    assert legacy != run
    os.rename(node / run, node / legacy)
    assert _resume(root, local) == (3, "local")
    assert os.listdir(node) == [run]
    assert sorted(os.listdir(node / run)) == ["root.json", "step-0000000002", "step-0000000003"]


def test_hot_copies_of_another_root_are_named_in_one_warning_with_what_to_do(tmp_path, caplog):
    local = str(tmp_path / "hot" / "node{node}")
    _save_steps(str(tmp_path / "a"), local, range(1, 4))
    [theirs] = os.listdir(tmp_path / "hot" / "node0")
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        other = _manager(str(tmp_path / "b"), local)
        assert other.load_latest(stepped_linear(-1)) is None
        other.save(1, stepped_linear(1))
        other.wait()
        assert _manager(str(tmp_path / "b"), local).load_latest(stepped_linear(-1))[0] == 1
    warnings = [r.getMessage() for r in caplog.records if "other durable roots" in r.getMessage()]
    assert len(warnings) == 1, warnings
    [message] = warnings
    assert f"{tmp_path / 'hot' / 'node0' / theirs} (root file://{os.path.realpath(tmp_path / 'a')}, " \
           f"step(s) 2, 3)" in message
    assert f"this run (root file://{os.path.realpath(tmp_path / 'b')})" in message
    assert "point CheckpointManager at that root" in message
    assert f"rm -r {tmp_path / 'hot' / 'node0' / theirs}" in message
    assert sorted(os.listdir(tmp_path / "hot" / "node0" / theirs)) == ["root.json", "step-0000000002",
                                                                       "step-0000000003"]  # left as it was


def test_copies_of_a_root_not_recorded_are_named_as_such(tmp_path, caplog):
    local = str(tmp_path / "hot" / "node{node}")
    _save_steps(str(tmp_path / "a"), local, range(1, 3))
    [theirs] = os.listdir(tmp_path / "hot" / "node0")
    os.remove(tmp_path / "hot" / "node0" / theirs / "root.json")
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        assert _manager(str(tmp_path / "b"), local).load_latest(stepped_linear(-1)) is None
    assert f"{theirs} (root not recorded: written by an earlier shardkit; step(s) 1, 2)" in caplog.text


def _warnings_on_each_rank(root: str) -> int:
    """Resume under a root other than the one whose hot copies the node holds; this rank's WARNINGs of it."""
    import torch.distributed as dist

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("shardkit").addHandler(handler)
    try:
        local = os.path.join(root, "hot", "node{node}")
        earlier = skc.CheckpointManager(os.path.join(root, "a"), local=local, local_world_size=2, replicas=0)
        earlier.save(1, stepped_linear(1))
        earlier.wait()
        dist.barrier()
        manager = skc.CheckpointManager(os.path.join(root, "b"), local=local, local_world_size=2, replicas=0)
        assert manager.load_latest(stepped_linear(-1)) is None
    finally:
        logging.getLogger("shardkit").removeHandler(handler)
    return sum("other durable roots" in m for m in seen)


def test_two_ranks_of_one_node_warn_once(tmp_path):
    assert run_on_ranks(2, _warnings_on_each_rank, str(tmp_path)) == [1, 0]


def test_the_shared_rendezvous_store_is_a_restart_hazard_only_with_restarts():
    torchrun = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "2"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_hazard(torchrun)
    assert "--max-restarts 2" in restart_hazard(torchrun)
    assert restart_hazard({**torchrun, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) is None
    assert restart_hazard({**torchrun, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert restart_hazard({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert restart_hazard({}) is None


@pytest.mark.slow
def test_a_torchrun_restart_that_would_hang_fails_in_seconds_naming_the_fix(tmp_path):
    started = time.monotonic()
    done = run_torchrun(RESTART_SCRIPT, 2, [str(tmp_path / "shared")], launcher_args=["--max-restarts", "1"],
                        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}, timeout=90)
    seconds = time.monotonic() - started
    printed = done.stdout + done.stderr
    assert done.returncode != 0, printed[-3000:]
    assert "attempt 0 rank 0: failing on purpose" in printed
    # attempt 0 warned (rank 0 alone), attempt 1 refused at `import shardkit.checkpoint`, before
    # init_process_group could hang
    assert printed.count("WARNING shardkit.checkpoint.training.restarts: torchrun restarts this job") == 1
    assert "ConfigurationError: attempt 1 of this job: torchrun restarts this job (--max-restarts 1)" in printed
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in printed
    assert seconds < 60, seconds
    # with the setting, the same job restarts and resumes: tests/project/test_example_hot_resume.py
