"""The hot tier at another mesh of the same world size: its copies hold another layout's local shards, so the
resume falls back to the durable root and the log says why (4 gloo ranks as 2 nodes of 2)."""

from __future__ import annotations

import logging
import os

import pytest

import shardkit.checkpoint as skc
from tests.support.checkpoint_helpers import build_model, make_optimizer, train
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow


def _manager(root: str) -> skc.CheckpointManager:
    return skc.CheckpointManager(os.path.join(root, "durable"), local=os.path.join(root, "hot", "node{node}"),
                                 local_world_size=2, durable_every=2)


def _save_on_a_1d_mesh_then_resume_on_a_2d_mesh(root: str) -> tuple[int, str, list[str]] | None:
    import torch.distributed as dist

    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("shardkit")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model = build_model("shardkit", seed=3)
        opt = make_optimizer(model)
        manager = _manager(root)
        for step in (1, 2, 3):  # hot steps 2 and 3 on both nodes, durable step 2
            train(model, opt, range(step, step + 1))
            manager.save(step, model, opt)
        relaid = build_model("shardkit", seed=4, mesh_shape=(2, 2))
        resumer = _manager(root)
        resumer.load_latest(relaid, make_optimizer(relaid), required=True)
        dist.barrier()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    if dist.get_rank() != 0:
        return None
    return resumer.last_load.step, resumer.last_load.source, [m for m in said if m.startswith("hot tier: steps")]


def test_a_resume_on_another_mesh_falls_back_to_the_durable_root_and_says_why(tmp_path):
    step, source, said = run_on_ranks(4, _save_on_a_1d_mesh_then_resume_on_a_2d_mesh, str(tmp_path))[0]
    assert (step, source) == (2, "durable")
    assert said == ["hot tier: steps 2, 3 were saved for another layout of the model (mesh, placements or "
                    "shapes); they are not used (such a job resumes from the durable root)"]
