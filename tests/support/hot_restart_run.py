"""A torchrun job for tests/checkpoint/training/hot/test_root_key.py, in the usual order: imports
``shardkit.checkpoint``, forms its process group, builds a ``CheckpointManager`` with the hot tier, fails its
first attempt on purpose, and on a restarted attempt saves and resumes one step.  ``argv[1]``: the run's
directory."""

from __future__ import annotations

import logging
import os
import sys

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

import torch.distributed as dist  # noqa: E402 - after the logging set-up: the import may warn
import torch.nn as nn  # noqa: E402

import shardkit.checkpoint as skc  # noqa: E402

root, attempt = sys.argv[1], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
manager = skc.CheckpointManager(os.path.join(root, "durable"), local=os.path.join(root, "hot", "node{node}"),
                                replicas=0)
if attempt == 0:
    print(f"attempt 0 rank {dist.get_rank()}: failing on purpose", flush=True)
    sys.exit(3)
model = nn.Linear(4, 2)
manager.save(1, model)
manager.wait()
print(f"attempt {attempt} rank {dist.get_rank()}: resumed {manager.load_latest(nn.Linear(4, 2))}", flush=True)
dist.destroy_process_group()
