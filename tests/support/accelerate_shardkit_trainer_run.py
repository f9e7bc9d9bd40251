"""``Trainer.train()`` on FSDP2 with shardkit writing and reading its ``checkpoint-N/`` (``use_shardkit``).

Launched by the tests with torchrun (2 ranks, gloo)::

    accelerate_shardkit_trainer_run.py write OUT    # the uninterrupted run and the interrupted one
    accelerate_shardkit_trainer_run.py resume OUT   # Trainer.train(resume_from_checkpoint=True)

As in ``accelerate_run.py``, the Trainer's accelerator is switched to FSDP
after it is built (Accelerate never selects FSDP on a CPU host); from then on
the Trainer wraps the model with ``fully_shard`` and its ``_save_checkpoint``
and ``_load_from_checkpoint`` take their FSDP paths.

``write``: ``OUT/whole`` trains ``STEPS`` steps saving every step with
``save_total_limit=2`` (the Trainer's rotation around shardkit's folders);
``OUT/stopped`` trains the same run saving every ``SAVE_EVERY`` steps and
stops after the first save, as a job that was killed.  ``resume``: a new
Trainer over ``OUT/stopped`` calls ``train(resume_from_checkpoint=True)``.
Each writes its ``log_history`` to ``OUT/<name>.log.json``.
"""

from __future__ import annotations

import json
import os
import sys

# `tests` importable by torchrun: the repository root, two folders above this file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402
from accelerate import PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from shardkit.integrations.accelerate import use_shardkit  # noqa: E402
from tests.support.framework_helpers import batch, build_model  # noqa: E402

STEPS = 4
SAVE_EVERY = 2


class FsdpOnCpuTrainer(Trainer):
    """The Trainer, its accelerator switched to FSDP2 once built (see the module docstring)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.is_fsdp_enabled = True


class StopAfterSave(TrainerCallback):
    """End training at the step the first checkpoint is written: the job dies there."""

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        control.should_training_stop = True
        return control


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    for state in (AcceleratorState, GradientState, PartialState):
        state._shared_state.clear()


def run(out: str, name: str, save_steps: int, *, limit: int | None = None, stop: bool = False,
        resume: bool = False) -> None:
    args = TrainingArguments(output_dir=os.path.join(out, name), use_cpu=True, max_steps=STEPS,
                             save_steps=save_steps, save_total_limit=limit, per_device_train_batch_size=2,
                             learning_rate=1e-2, weight_decay=0.01, lr_scheduler_type="linear", report_to=[],
                             logging_steps=1, seed=0, disable_tqdm=True, fsdp="full_shard auto_wrap",
                             fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                          "state_dict_type": "SHARDED_STATE_DICT"})
    data = [{"input_ids": ids, "labels": ids} for n in range(1, 9) for r in range(2) for ids in batch(n, r)]
    trainer = FsdpOnCpuTrainer(model=build_model(), args=args, train_dataset=data,
                               callbacks=[StopAfterSave()] if stop else None)
    trainer.train(resume_from_checkpoint=True if resume else None)
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"{name}{'-resumed' if resume else ''}.log.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
    trainer.accelerator.wait_for_everyone()
    reset_accelerate()


def main(argv: list[str]) -> None:
    mode, out = argv
    with use_shardkit():
        if mode == "write":
            run(out, "whole", 1, limit=2)
            run(out, "stopped", SAVE_EVERY, stop=True)
        else:
            run(out, "stopped", SAVE_EVERY, resume=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
