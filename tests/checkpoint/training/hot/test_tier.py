"""The hot tier: every step on node-local directories with replicas on the other node, durable every 5.

4 gloo ranks play 2 nodes of 2 (``local_world_size=2``, a directory per node).  A 12-step run, as it
stood after step 9, left hot steps 8 and 9 and durable step 5; each test restores those directories,
breaks them in one way, resumes, and checks that the state after recovery is bitwise the uninterrupted
run's at the recovered step and that the following losses are bitwise its losses.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator

import pytest

import shardkit.checkpoint as skc
from tests.support.checkpoint_helpers import build_model, full_state, make_optimizer, mismatches, train
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow

SAVED_STEPS, TOTAL_STEPS, DURABLE_EVERY = 9, 12, 5


def _manager(root: str, async_save: bool) -> skc.CheckpointManager:
    return skc.CheckpointManager(os.path.join(root, "durable"), local=os.path.join(root, "hot", "node{node}"),
                                 local_world_size=2, replicas=1, local_keep=2, durable_every=DURABLE_EVERY,
                                 async_save=async_save)


def _run(root: str, *, resume: bool, until: int, snapshots: tuple[int, ...] = (), keep_at: int | None = None,
         async_save: bool = False) -> dict | None:
    """Train to step ``until``, saving every step; on resume start from ``load_latest``.  Rank 0 returns
    the losses by step, the state right after the resume (or at ``snapshots``) and how the resume went.
    ``keep_at``: once that step is saved, rank 0 copies the run's directories to ``<root>.pristine``."""
    import torch.distributed as dist

    model = build_model("shardkit", seed=3)
    opt = make_optimizer(model)
    manager = _manager(root, async_save)
    start, resumed, taken = 0, None, {}
    if resume:
        arrivals = []
        with _counting_arrivals(arrivals):
            start, extra = manager.load_latest(model, opt, required=True)
        assert extra == {"step": start}
        resumed = {"step": manager.last_load.step, "source": manager.last_load.source,
                   "state": full_state(model, opt), "collectives": len(arrivals)}
    losses = {}
    for step in range(start + 1, until + 1):
        losses[step] = train(model, opt, range(step, step + 1))[0]
        manager.save(step, model, opt, extra={"step": step})
        if step in snapshots:
            taken[step] = full_state(model, opt)
        if step == keep_at:
            manager.wait()
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.copytree(root, root + ".pristine")
            dist.barrier()
    manager.wait()
    dist.barrier()
    return {"losses": losses, "resumed": resumed, "snapshots": taken} if dist.get_rank() == 0 else None


@contextlib.contextmanager
def _counting_arrivals(arrivals: list) -> Iterator[None]:
    """Every collective (and round of transfers) checks in once at its start: counted into ``arrivals``."""
    from shardkit.checkpoint.io.dist import Dist

    original = Dist.arrive

    def counted(self, *args, **kwargs):
        arrivals.append(self.phase)
        return original(self, *args, **kwargs)

    Dist.arrive = counted
    try:
        yield
    finally:
        Dist.arrive = original


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 12-step run, saved in the background (``async_save=True``: a durable step is written
    from the hot save's host copy), with the state at every step a test may recover, and its directories as
    they were after step 9: hot steps 8 and 9 on both nodes, durable step 5."""
    root = str(tmp_path_factory.mktemp("reference") / "run")
    run = run_on_ranks(4, _run, root, resume=False, until=TOTAL_STEPS, snapshots=(5, 9), keep_at=SAVED_STEPS,
                       async_save=True)[0]
    return {**run, "root": root}


@pytest.fixture
def saved(reference):
    """(the run's root, its pristine copy after step 9): the hot tier belongs to its durable root's URL, so
    each test restores the run in place instead of copying it elsewhere."""
    return reference["root"], reference["root"] + ".pristine"


def _copy_of(saved: tuple[str, str], tmp_path) -> str:
    root, pristine = saved
    shutil.rmtree(root)
    shutil.copytree(pristine, root)
    return root


def _files(node_dir: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(node_dir) for f in files)


def _damage_every_file(node_dir: str) -> None:
    """Flip one byte in the middle of every data file and truncate every manifest of the node."""
    for path in _files(node_dir):
        if path.endswith((".safetensors", "state.bin")):
            with open(path, "r+b") as f:
                size = os.path.getsize(path)
                f.seek(size // 2)
                byte = f.read(1)
                f.seek(size // 2)
                f.write(bytes([byte[0] ^ 0xFF]))
        elif path.endswith("manifest.json"):
            os.truncate(path, os.path.getsize(path) // 2)


def _resumes_as_the_uninterrupted_run(root: str, reference: dict, step: int, source: str, world: int = 4,
                                      collectives: int | None = None) -> None:
    got = run_on_ranks(world, _run, root, resume=True, until=TOTAL_STEPS)[0]
    assert (got["resumed"]["step"], got["resumed"]["source"]) == (step, source)
    if collectives is not None:
        assert got["resumed"]["collectives"] == collectives
    assert mismatches(got["resumed"]["state"], reference["snapshots"][step]) == []
    want = {s: reference["losses"][s] for s in range(step + 1, TOTAL_STEPS + 1)}
    if world == 4:
        assert got["losses"] == want  # bitwise
    else:  # another split of each global batch: the same math in another summation order
        assert got["losses"].keys() == want.keys()
        assert all(abs(got["losses"][s] - want[s]) <= 1e-6 * abs(want[s]) for s in want)


def test_the_saved_run_leaves_two_complete_hot_steps_per_node_and_the_durable_step(saved):
    _, saved = saved
    for node in (0, 1):
        [run] = os.listdir(os.path.join(saved, "hot", f"node{node}"))
        assert run.startswith("run-")
        node_dir = os.path.join(saved, "hot", f"node{node}", run)
        assert sorted(os.listdir(node_dir)) == ["root.json", "step-0000000008", "step-0000000009"]
        for step in (8, 9):
            names = sorted(os.listdir(os.path.join(node_dir, f"step-000000000{step}")))
            kinds = sorted(n.split(".")[0] for n in names)
            own = [f"rank-{r}" for r in (2 * node, 2 * node + 1)]
            replicas = [f"replica-{r}" for r in (2 * (1 - node), 2 * (1 - node) + 1)]
            assert kinds == sorted(["complete"] + own + replicas)
    assert sorted(os.listdir(os.path.join(saved, "durable"))) == ["step-0000000005"]


def test_all_local_copies_intact_resume_from_the_local_tier(saved, reference, tmp_path):
    # two collectives: the hot tier's one exchange of reports (rank 0's listing of the durable root's steps in
    # it; each rank's own copy checked before it as far as it can be without writing a target, input state
    # included), and the agreement that every rank read its copy into its targets, checked, and applied it
    _resumes_as_the_uninterrupted_run(_copy_of(saved, tmp_path), reference, 9, "local", collectives=2)


def test_one_node_wiped_resumes_from_the_replicas_on_the_other_node(saved, reference, tmp_path):
    root = _copy_of(saved, tmp_path)
    shutil.rmtree(os.path.join(root, "hot", "node1"))
    # five: as from the local tier, plus the round that brings node 1's manifests, the one exchange of which
    # copies check out (and which could not be sent), and the round that brings their data straight into the
    # targets (checked as it arrives)
    _resumes_as_the_uninterrupted_run(root, reference, 9, "peer", collectives=5)
    assert not [n for d, _, names in os.walk(os.path.join(root, "hot")) for n in names + [d] if "fetched" in n]


def test_every_file_of_one_node_damaged_resumes_from_the_replicas(saved, reference, tmp_path):
    root = _copy_of(saved, tmp_path)
    _damage_every_file(os.path.join(root, "hot", "node0"))
    _resumes_as_the_uninterrupted_run(root, reference, 9, "peer")


def test_one_node_wiped_and_the_other_damaged_resumes_from_the_newest_durable_step(saved, reference, tmp_path):
    root = _copy_of(saved, tmp_path)
    shutil.rmtree(os.path.join(root, "hot", "node0"))
    _damage_every_file(os.path.join(root, "hot", "node1"))
    _resumes_as_the_uninterrupted_run(root, reference, 5, "durable")


def test_a_resume_on_fewer_ranks_falls_back_to_the_durable_root(saved, reference, tmp_path):
    root = _copy_of(saved, tmp_path)
    _resumes_as_the_uninterrupted_run(root, reference, 5, "durable", world=2)
