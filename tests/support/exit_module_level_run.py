"""A training script with everything at module level: two steps, each saved in the background, hot tier on.

    torchrun --nproc_per_node 2 tests/support/exit_module_level_run.py OUT [--bare] [--writer process|thread]

The model, its optimizer and the ``CheckpointManager`` (``async_save=True``,
``local=OUT/hot/node{node}``; written from a thread unless ``--writer
process``) are globals of ``__main__``, so they -- and the meshes and process
groups they hold -- are still alive when the interpreter exits, as in a
notebook-style script.  By default the script ends as the docs ask
(``manager.wait()``, a barrier, ``destroy_process_group()``); ``--bare`` ends
right after the last ``save``, leaving the background save in flight and the
default group up: the save must still commit (see
:func:`shardkit.held_groups.finish_before_exit`).
Either way every rank must exit 0 (``exit_soak.py`` launches it many times).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import shardkit.checkpoint as skc
from shardkit import fully_shard

OUT = Path(sys.argv[1])
BARE = "--bare" in sys.argv[2:]
WRITER = sys.argv[sys.argv.index("--writer") + 1] if "--writer" in sys.argv else "thread"
STEPS = 2

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
manager = skc.CheckpointManager(str(OUT / "ckpt"), async_save=True, writer=WRITER, keep_last=2,
                                local=str(OUT / "hot" / "node{node}"))
inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
for step in range(1, STEPS + 1):
    loss = model(inputs).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    manager.save(step, model, optimizer)
if not BARE:
    manager.wait()
    dist.barrier()
    dist.destroy_process_group()
