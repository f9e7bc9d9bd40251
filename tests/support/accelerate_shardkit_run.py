"""An Accelerate FSDP2 training loop whose checkpoints shardkit writes and reads (``use_shardkit``).

Launched by the tests with torchrun::

    accelerate_shardkit_run.py write OUT      # 2 ranks: the uninterrupted run, and the checkpoints it saves
    accelerate_shardkit_run.py resume OUT     # 2 or 1 ranks: resume each checkpoint, write what followed

Accelerate runs FSDP only on an accelerator (on CPU it never selects FSDP:
``accelerate/state.py``, ``AcceleratorState.__init__``, where the FSDP branch
is taken only for the ``MULTI_GPU``...``MULTI_NEURON`` distributed types and
``MULTI_CPU`` is not among them), so, as in ``accelerate_run.py``, the state is
switched to FSDP after the accelerator is built; from then on ``prepare``
shards with torch's ``fully_shard`` and ``save_state``/``load_state`` take
their FSDP2 paths.

The loop is a user's: a tiny Llama, AdamW, a ``LambdaLR`` schedule that moves
every step, and a shuffled ``DataLoader`` with Accelerate's seedable sampler,
all through ``accelerator.prepare``.  The global batch is 4 samples at any
world size (2 per rank on 2 ranks, 4 on 1), so a run resumed on one rank
takes the same steps.

``write``: trains ``SAVED`` steps, saves with Accelerate's own engine into
``OUT/dcp`` and with shardkit into ``OUT/shardkit``, trains ``AFTER`` more
steps, and writes their losses and sample ids (``OUT/run.json``); then
saves three times with ``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=2)`` into ``OUT/project``.  ``resume``: for ``shardkit`` and
``dcp``, a fresh accelerator, model and optimizer load the checkpoint with
``use_shardkit()`` on, skip the batches already seen, train ``AFTER`` steps
and write what they saw (``OUT/resumed-<case>-<world>.json``).
"""

from __future__ import annotations

import json
import os
import sys

# `tests` importable by torchrun: the repository root, two folders above this file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, DistributedType, FullyShardedDataParallelPlugin  # noqa: E402

from shardkit.integrations.accelerate import use_shardkit  # noqa: E402
from tests.support.framework_helpers import VOCAB, build_model  # noqa: E402

SAVED = 2        # steps before the save
AFTER = 3        # steps after it, which a resumed run must reproduce
GLOBAL_BATCH = 4
SAMPLES = 32     # one epoch: 8 steps


class Tokens(torch.utils.data.Dataset):
    """Sample ``i``: its id and 8 token ids drawn from a generator seeded by ``i``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(i))
        return {"index": torch.tensor(i), "input_ids": ids}


def reset_accelerate() -> None:
    """Forget the accelerator (Accelerate keeps it process-wide) so the next case builds its own."""
    from accelerate.state import AcceleratorState, GradientState

    for state in (AcceleratorState, GradientState, PartialState):
        state._shared_state.clear()


def build() -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, object, object]:
    """A fresh accelerator on FSDP2 (``SHARDED_STATE_DICT``) and the prepared model, optimizer, data, schedule."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, step_scheduler_with_optimizer=False,
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    acc.state.distributed_type = DistributedType.FSDP  # the switch of the module docstring
    acc.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    data = torch.utils.data.DataLoader(Tokens(), batch_size=GLOBAL_BATCH // dist.get_world_size(), shuffle=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    model, opt, data, sched = acc.prepare(model, opt, data, sched)
    return acc, model, opt, data, sched


def train(acc: Accelerator, model, opt, sched, batches, steps: int) -> tuple[list[float], list[list[int]]]:
    """``steps`` steps; the global mean loss of each and the sample ids every rank saw, in rank order."""
    losses, seen = [], []
    for _ in range(steps):
        batch = next(batches)
        ids = batch["input_ids"]
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        seen.append(sorted(int(i) for i in acc.gather(batch["index"])))
    return losses, seen


def write(out: str) -> None:
    torch.manual_seed(7)
    acc, model, opt, data, sched = build()
    batches = iter(data)
    train(acc, model, opt, sched, batches, SAVED)
    acc.save_state(os.path.join(out, "dcp"))  # Accelerate's own DCP, as before the switch
    with use_shardkit():
        acc.save_state(os.path.join(out, "shardkit"))
    losses, seen = train(acc, model, opt, sched, batches, AFTER)
    with use_shardkit():  # Accelerate's retention around shardkit's folders
        acc.project_configuration.automatic_checkpoint_naming = True
        acc.project_configuration.total_limit = 2
        acc.project_configuration.set_directories(os.path.join(out, "project"))
        for _ in range(3):
            acc.save_state()
    if dist.get_rank() == 0:
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump({"losses": losses, "seen": seen}, f)
    acc.wait_for_everyone()
    reset_accelerate()


def resume(out: str) -> None:
    world = dist.get_world_size()
    with use_shardkit():
        for case in ("shardkit", "dcp"):
            torch.manual_seed(123)  # other weights and RNG than the run saved: the checkpoint must bring them
            acc, model, opt, data, sched = build()
            acc.load_state(os.path.join(out, case))
            batches = iter(acc.skip_first_batches(data, SAVED))
            losses, seen = train(acc, model, opt, sched, batches, AFTER)
            if dist.get_rank() == 0:
                with open(os.path.join(out, f"resumed-{case}-{world}.json"), "w") as f:
                    json.dump({"losses": losses, "seen": seen, "lr": sched.get_last_lr()}, f)
            acc.wait_for_everyone()
            reset_accelerate()


def main(argv: list[str]) -> None:
    if not dist.is_initialized():  # one rank: Accelerate starts no process group, fully_shard needs one
        dist.init_process_group("gloo")
    {"write": write, "resume": resume}[argv[0]](argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
