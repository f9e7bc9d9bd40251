"""What the framework-checkpoint tests and the scripts writing their checkpoints share.

``deepspeed_run.py`` (DeepSpeed ZeRO) and ``accelerate_run.py`` (Accelerate
and the Hugging Face Trainer) train the same tiny Llama, built from a config,
on the same batches (a function of the step and the data-parallel rank, so a
resumed run can draw the same ones); here are both, the cases each script
writes, and their launch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support.dist import run_torchrun

VOCAB = 64
STEPS_SAVED = 2   # steps trained before the save
STEPS_AFTER = 2   # steps DeepSpeed trains after it, whose losses a resumed run must reproduce
DS_WORLD = 2      # the ranks the frameworks train on
FRAMEWORK_RUN_S = 600  # deadline of one framework run that writes a test module's checkpoints
# the pytest timeout of a module whose fixture launches such a run: its first test also waits for the run
# (tens of seconds on 2 cores, minutes on a loaded machine), which has its own deadline above
FRAMEWORK_MODULE_TIMEOUT = pytest.mark.timeout(FRAMEWORK_RUN_S + 300)
# DeepSpeed cases, name: (stage, optimizer, tied embeddings and a frozen norm, variant), where the variant is
# "odd" (a parameter count that is not a multiple of 2 x world size, so ZeRO pads the last rank's partition)
# or "groups" (two param groups, the norms without weight decay, and at stage 3 sub-groups of 3000 elements)
CASES = {
    "stage3": (3, "adamw", False, ""),
    "stage2-adagrad": (2, "adagrad", False, ""),
    "stage3-tied-frozen": (3, "adamw", True, ""),
    "stage2-tied-frozen": (2, "adamw", True, ""),
    "stage1-odd": (1, "adamw", False, "odd"),
    "stage3-odd": (3, "adamw", False, "odd"),
    "stage3-groups": (3, "adamw", False, "groups"),
}
STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "adagrad": ("sum",)}
# Accelerate cases, name: (FSDP version or 0 for the DDP fallback, state_dict_type)
ACCELERATE_CASES = {
    "fsdp2-sharded": (2, "SHARDED_STATE_DICT"),
    "fsdp2-full": (2, "FULL_STATE_DICT"),
    "fsdp1-sharded": (1, "SHARDED_STATE_DICT"),
    "ddp": (0, None),
}
TRAINER_CASES = {"trainer-fsdp2-sharded": (2, "SHARDED_STATE_DICT"), "trainer-ddp": (0, None)}
PROBE = torch.arange(24).reshape(3, 8) % VOCAB  # the input whose logits a converted model must reproduce


def build_model(tied: bool = False, hidden: int = 32, vocab: int = VOCAB, odd: bool = False) -> torch.nn.Module:
    """The tiny Llama every case trains (seeded: the same weights on every rank and in every test)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(tied, hidden, vocab, odd))
    if tied:
        model.model.norm.weight.requires_grad_(False)
    return model


def llama_config(tied: bool = False, hidden: int = 32, vocab: int = VOCAB, odd: bool = False):
    """The tiny Llama's config; ``odd``: sizes that make 23,970 parameters (2 more than a multiple of 4)."""
    from transformers import LlamaConfig

    if odd:
        return LlamaConfig(vocab_size=67, hidden_size=34, intermediate_size=49, num_hidden_layers=2,
                           num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=tied)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def batch(step: int, rank: int, vocab: int = VOCAB) -> torch.Tensor:
    """Data-parallel rank ``rank``'s token ids at ``step`` (2 sequences of 8)."""
    return torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(1000 * step + rank))


def global_batch(step: int, vocab: int = VOCAB) -> torch.Tensor:
    """Every DeepSpeed rank's batch at ``step``, in rank order: what one step of the whole job saw."""
    return torch.cat([batch(step, r, vocab) for r in range(DS_WORLD)])


def write_checkpoints(script: str, out: str | os.PathLike, *extra: str, timeout: float | None = None) -> None:
    """Run ``script`` (``deepspeed_run.py``, ``accelerate_run.py``) on 2 gloo ranks, writing into ``out``."""
    done = run_torchrun(Path(__file__).with_name(script), DS_WORLD, [str(out), *extra],
                        timeout=FRAMEWORK_RUN_S if timeout is None else timeout,
                        env={"DS_ACCELERATOR": "cpu"})
    if done.returncode != 0:
        raise AssertionError(f"{script} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


def resume_and_train(ckpt: str, tied: bool = False) -> list[float]:
    """On every rank: a fully sharded Llama and a torch AdamW (wrong hyperparameters on purpose) loaded from
    ``ckpt`` (a framework's checkpoint, or one converted from it), then trained on the steps the framework
    trained after its save (each rank sees the whole job's batch, so any world size computes the same step)."""
    import shardkit.checkpoint as skc
    from shardkit import fully_shard
    from shardkit.checkpoint.training.input_state import stored_input_state
    from shardkit.data.resume import load_data_state_dict

    torch.manual_seed(123)
    model = build_model(tied)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5, weight_decay=0.5)
    inputs = stored_input_state(ckpt)  # every rank's RNG state, when the checkpoint holds it
    sd = {**skc.get_training_state(model, opt), **inputs}
    skc.load(sd, ckpt)
    skc.set_training_state(model, opt, sd)
    if "rng" in inputs:
        load_data_state_dict(inputs)
    losses = []
    for step in range(STEPS_SAVED + 1, STEPS_SAVED + STEPS_AFTER + 1):
        ids = global_batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
