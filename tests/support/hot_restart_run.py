"""A torchrun job for tests/checkpoint/training/hot/test_root_key.py: builds a ``CheckpointManager`` with the
hot tier *before* ``init_process_group``, fails its first attempt on purpose, and on a restarted attempt
saves and resumes one step.  ``argv[1]``: the run's directory."""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist
import torch.nn as nn

import shardkit.checkpoint as skc

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
root, attempt = sys.argv[1], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
manager = skc.CheckpointManager(os.path.join(root, "durable"), local=os.path.join(root, "hot", "node{node}"),
                                replicas=0)
dist.init_process_group("gloo")
if attempt == 0:
    print(f"attempt 0 rank {dist.get_rank()}: failing on purpose", flush=True)
    sys.exit(3)
model = nn.Linear(4, 2)
manager.save(1, model)
manager.wait()
print(f"attempt {attempt} rank {dist.get_rank()}: resumed {manager.load_latest(nn.Linear(4, 2))}", flush=True)
dist.destroy_process_group()
