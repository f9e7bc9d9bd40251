"""Write real Accelerate and Hugging Face Trainer checkpoints on CPU, with what a test compares them to.

Launched by the tests with torchrun (2 ranks, gloo)::

    accelerate_run.py OUT

Accelerate and Trainer run FSDP only on an accelerator: on a CPU host they
silently fall back to DDP.  To run their real FSDP save paths here, the
accelerator's state is switched to FSDP after it is built (the distributed
type on ``AcceleratorState`` and on the ``PartialState`` it mirrors, the
FSDP plugin, and for FSDP1 a plain ``cpu`` device with
``sync_module_states=False``); from then on ``prepare`` wraps the model with
torch's FSDP and ``save_state`` writes what it writes on GPUs.  Cases:

* accelerate ``fsdp2-sharded``, ``fsdp2-full``, ``fsdp1-sharded``: FSDP with
  that state-dict type; ``ddp``: the fallback CPU users get;
* trainer ``trainer-fsdp2-sharded`` and ``trainer-ddp``: ``Trainer.train``
  with ``save_steps``, writing ``checkpoint-2/``.

Each accelerate case trains a tiny Llama two steps on ``batch(step, rank)``,
calls ``accelerator.save_state(OUT/<case>)``, writes the trained model's
logits on a fixed input (``<case>.logits.safetensors``), then trains two more
steps and writes their losses (``<case>.losses.json``): what a run resumed
from the checkpoint must reproduce.  Each Trainer case writes the trained
model's full state dict beside its checkpoint (``<case>.model.safetensors``).
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
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.support.framework_helpers import (  # noqa: E402
    ACCELERATE_CASES,
    PROBE,
    STEPS_AFTER,
    STEPS_SAVED,
    TRAINER_CASES,
    batch,
    build_model,
)


def fsdp_plugin(version: int, state_dict_type: str) -> FullyShardedDataParallelPlugin:
    extra = {"sync_module_states": False, "use_orig_params": True} if version == 1 else {}
    return FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=state_dict_type,
                                          auto_wrap_policy="transformer_based_wrap",
                                          transformer_cls_names_to_wrap=["LlamaDecoderLayer"], **extra)


def switch_to_fsdp(acc: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Make a CPU accelerator take its FSDP paths (see the module docstring)."""
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if plugin.fsdp_version == 1:
        acc.state.device = torch.device("cpu")
        PartialState._shared_state["device"] = torch.device("cpu")


def step(acc: Accelerator, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> float:
    ids = batch(n, dist.get_rank())
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def accelerate_case(out: str, name: str, version: int, state_dict_type: str | None) -> None:
    plugin = fsdp_plugin(version, state_dict_type) if version else None
    acc = Accelerator(cpu=True, fsdp_plugin=plugin) if plugin else Accelerator(cpu=True)
    if plugin:
        switch_to_fsdp(acc, plugin)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = acc.prepare(model, opt)
    for n in range(1, STEPS_SAVED + 1):
        step(acc, model, opt, n)
    path = os.path.join(out, name)
    acc.save_state(path)
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    after = [step(acc, model, opt, n) for n in range(STEPS_SAVED + 1, STEPS_SAVED + STEPS_AFTER + 1)]
    if dist.get_rank() == 0:
        save_file({"logits": logits.contiguous()}, f"{path}.logits.safetensors")
        with open(f"{path}.losses.json", "w") as f:
            json.dump({"after_save": after}, f)
    acc.wait_for_everyone()
    reset_accelerate()


def reset_accelerate() -> None:
    """Forget the accelerator (accelerate keeps it process-wide) so the next case builds its own."""
    from accelerate.state import AcceleratorState, GradientState

    for state in (AcceleratorState, GradientState, PartialState):
        state._shared_state.clear()


def trainer_case(out: str, name: str, version: int, state_dict_type: str | None) -> None:
    from transformers import Trainer, TrainingArguments

    class FsdpOnCpuTrainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if version:
                switch_to_fsdp(self.accelerator, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
                self.is_fsdp_enabled = True

    fsdp = {"fsdp": "full_shard auto_wrap", "fsdp_config": {
        "version": version, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "state_dict_type": state_dict_type}} if version else {}
    args = TrainingArguments(output_dir=os.path.join(out, name), use_cpu=True, max_steps=STEPS_SAVED,
                             save_steps=STEPS_SAVED, per_device_train_batch_size=2, learning_rate=1e-2,
                             weight_decay=0.01, lr_scheduler_type="constant", report_to=[], logging_steps=1,
                             seed=0, disable_tqdm=True, **fsdp)
    data = [{"input_ids": ids, "labels": ids} for n in range(1, 5) for r in range(2) for ids in batch(n, r)]
    trainer = FsdpOnCpuTrainer(model=build_model(), args=args, train_dataset=data)
    trainer.train()
    state = trainer.accelerator.get_state_dict(trainer.model)  # the trained model, whole, on rank 0
    with torch.no_grad():
        logits = trainer.model(input_ids=PROBE).logits
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, f"{name}.model.safetensors"))
        save_file({"logits": logits.contiguous()}, os.path.join(out, f"{name}.logits.safetensors"))
    trainer.accelerator.wait_for_everyone()
    reset_accelerate()


def main(argv: list[str]) -> None:
    out = argv[0]
    for name, (version, state_dict_type) in ACCELERATE_CASES.items():
        accelerate_case(out, name, version, state_dict_type)
    for name, (version, state_dict_type) in TRAINER_CASES.items():
        trainer_case(out, name, version, state_dict_type)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
