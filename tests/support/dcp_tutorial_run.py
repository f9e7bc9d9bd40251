"""torch's DCP tutorial ("Getting started with Distributed Checkpoint"), run with torch's modules or shardkit's.

Launched by the tests with torchrun (2 ranks, gloo)::

    dcp_tutorial_run.py MODULES PHASE CHECKPOINT OUT

``MODULES`` picks the two imports docs/migration.md swaps -- ``torch``
(``torch.distributed.checkpoint`` and its ``state_dict`` functions) or
``shardkit`` (``shardkit.checkpoint`` and ``shardkit.checkpoint.state_dict``);
below them the tutorial's code is unchanged but for CPU and gloo instead of
CUDA and NCCL, and a few training steps instead of one.  ``PHASE``:

* ``save``: train ``STEPS`` steps from seed 0, ``dcp.save({"app": AppState(model, optimizer)},
  checkpoint_id=CHECKPOINT)``; rank 0 also writes the full model and optimizer state it saved to
  ``OUT.expected.pt`` (what a resume must hold, bitwise);
* ``resume``: a new process builds the model from another seed, ``dcp.load({"app": AppState(model,
  optimizer)}, checkpoint_id=CHECKPOINT)``, trains ``STEPS`` more;
* ``manager``: as ``resume``, but ``shardkit.checkpoint.CheckpointManager(CHECKPOINT's folder)
  .load_latest(model, optimizer, from_dcp="app")`` resumes the step folder the DCP loop wrote;
* ``straight``: ``2 * STEPS`` steps from seed 0, uninterrupted.

Each rank writes the losses of its steps to ``OUT.rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys

MODULES, PHASE, CHECKPOINT, OUT = sys.argv[1:5]

if MODULES == "torch":
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
elif MODULES == "shardkit":
    import shardkit.checkpoint as dcp
    from shardkit.checkpoint.state_dict import get_state_dict, set_state_dict
else:
    raise SystemExit(f"MODULES must be torch or shardkit, got {MODULES!r}")

# ---- the tutorial, from here on -----------------------------------------------------------------
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

STEPS = 3


class AppState(Stateful):
    """This is a useful wrapper for checkpointing the Application State. Since this object is compliant
    with the Stateful protocol, DCP will automatically call state_dict/load_state_dict as needed in the
    dcp.save/load APIs."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        # this line automatically manages FSDP FQN's, as well as sets the default state dict type to
        # FSDP.SHARDED_STATE_DICT
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        # sets our state dicts on the model and optimizer, now that we've loaded
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.rand(8, 16, generator=g), torch.rand(8, 8, generator=g)


def train(model, optimizer, steps: range) -> list[float]:
    loss_fn = nn.MSELoss()
    losses = []
    for step in steps:
        x, y = batch(step, dist.get_rank())
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0 if PHASE in ("save", "straight") else 1234)  # a resume must not start from the same init
    model = fully_shard(ToyModel())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    if PHASE == "save":
        losses = train(model, optimizer, range(STEPS))
        state_dict = {"app": AppState(model, optimizer)}
        dcp.save(state_dict, checkpoint_id=CHECKPOINT)
        write_expected(model, optimizer)
    elif PHASE == "resume":
        state_dict = {"app": AppState(model, optimizer)}
        dcp.load(state_dict=state_dict, checkpoint_id=CHECKPOINT)
        losses = train(model, optimizer, range(STEPS, 2 * STEPS))
    elif PHASE == "manager":
        from shardkit.checkpoint import CheckpointManager

        resumed = CheckpointManager(os.path.dirname(CHECKPOINT)).load_latest(model, optimizer, from_dcp="app",
                                                                             required=True)
        assert resumed == (STEPS, None), resumed
        losses = train(model, optimizer, range(STEPS, 2 * STEPS))
    else:
        losses = train(model, optimizer, range(2 * STEPS))
    with open(f"{OUT}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()


def write_expected(model, optimizer) -> None:
    """The full model and optimizer state just saved (torch's own gathering), on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = torch_get_state_dict(model, optimizer, options=full)
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, f"{OUT}.expected.pt")


if __name__ == "__main__":
    main()
