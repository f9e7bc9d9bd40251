"""Write real DeepSpeed ZeRO checkpoints on CPU, with DeepSpeed's own reconstructions beside them.

Launched by the tests with torchrun (2 ranks, gloo, ``DS_ACCELERATOR=cpu``)::

    deepspeed_run.py OUT [--big-embedding ROWS]

For each case (ZeRO stage, optimizer, model variant) a tiny Llama built from a
config trains two steps and ``engine.save_checkpoint(OUT/<case>)`` writes the
checkpoint.  Rank 0 then writes, beside it, what DeepSpeed itself says the
checkpoint holds:

* ``<case>.zero_to_fp32.safetensors``: ``get_fp32_state_dict_from_zero_checkpoint``;
* ``<case>.live.safetensors``: every parameter's fp32 master weights and
  optimizer state as the live engine holds them (``safe_get_full_fp32_param``,
  ``safe_get_full_optimizer_state``, collected on every rank).

``unsafe`` is a stage-2 checkpoint saved with ``client_state`` holding an
``argparse.Namespace`` (what training scripts commonly store), a class no
allowlist should let through.  ``--big-embedding ROWS`` writes one more case,
``big``: stage 2, a model with a ROWS x 1024 embedding, saved after one step.

DeepSpeed's CPU accelerator JIT-builds an optional shared-memory all-reduce
kernel at start-up (tens of seconds with g++); these runs use gloo's
all-reduce instead and skip the build.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# `tests` importable by torchrun: the repository root, two folders above this file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.support.framework_helpers import (  # noqa: E402
    CASES,
    STATE_KEYS,
    STEPS_AFTER,
    STEPS_SAVED,
    VOCAB,
    batch,
    build_model,
)

# the optional shm kernel: gloo does the all-reduce.  Patched in the module itself: ``import
# deepspeed.comm.torch as m`` binds the attribute ``deepspeed.comm.torch``, which is torch itself.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def engine_for(model: torch.nn.Module, stage: int, optimizer: str, variant: str = "") -> deepspeed.DeepSpeedEngine:
    zero = {"stage": stage, **({"sub_group_size": 3000} if variant == "groups" else {})}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params: list = [p for _, p in trainable]
    if variant == "groups":
        params = [{"params": [p for n, p in trainable if "norm" not in n], "weight_decay": 0.01},
                  {"params": [p for n, p in trainable if "norm" in n], "weight_decay": 0.0}]
    if optimizer == "adamw":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adagrad(params, lr=0.05), config=config)
    return engine


def train(engine: deepspeed.DeepSpeedEngine, steps: range, vocab: int = VOCAB) -> list[float]:
    """Train ``steps`` (numbered from 1); the losses averaged over the ranks, as the whole job saw them."""
    losses = []
    for step in steps:
        ids = batch(step, dist.get_rank(), vocab)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def live_state(engine: deepspeed.DeepSpeedEngine, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """fp32 master weights and optimizer state per parameter, as the engine holds them (a collective)."""
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out[f"model.{name}"] = safe_get_full_fp32_param(p).detach().clone()
        for key in keys:
            out[f"optim.state.{name}.{key}"] = safe_get_full_optimizer_state(p, key).detach().clone()
    return out


def write_case(out: str, name: str, stage: int, optimizer: str, tied: bool, variant: str = "",
               client_state: dict | None = None, **model_kw: int) -> None:
    model = build_model(tied, odd=variant == "odd", **model_kw)
    engine = engine_for(model, stage, optimizer, variant)
    vocab = model_kw.get("vocab", VOCAB)
    big = bool(model_kw)
    train(engine, range(1, 2 if big else STEPS_SAVED + 1), vocab)
    path = os.path.join(out, name)
    engine.save_checkpoint(path, client_state=client_state or {})
    if big:
        dist.barrier()
        return
    live = live_state(engine, STATE_KEYS[optimizer])
    after = train(engine, range(STEPS_SAVED + 1, STEPS_SAVED + STEPS_AFTER + 1))
    dist.barrier()
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in live.items()}, f"{path}.live.safetensors")
        rebuilt = get_fp32_state_dict_from_zero_checkpoint(path)
        save_file({f"model.{k}": v.clone() for k, v in rebuilt.items()}, f"{path}.zero_to_fp32.safetensors")
        with open(f"{path}.losses.json", "w") as f:
            json.dump({"after_save": after}, f)
    dist.barrier()
    engine.destroy()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--big-embedding", type=int, default=0)
    parser.add_argument("--only-big", action="store_true")
    args = parser.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    if not args.only_big:
        for name, (stage, optimizer, tied, variant) in CASES.items():
            write_case(args.out, name, stage, optimizer, tied, variant)
        write_case(args.out, "unsafe", 2, "adamw", False, client_state={"args": argparse.Namespace(lr=0.01)})
    if args.big_embedding:
        write_case(args.out, "big", 2, "adamw", False, hidden=1024, vocab=args.big_embedding)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
