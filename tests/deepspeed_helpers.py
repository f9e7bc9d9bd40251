"""What the DeepSpeed tests and the script writing their checkpoints (``deepspeed_run.py``) share.

The cases, the model (a tiny Llama built from a config), the batches every
step trains on (a function of the step and the data-parallel rank, so a
resumed run can draw the same ones) and the launch of the script.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.dist import run_torchrun

VOCAB = 64
STEPS_SAVED = 2   # steps trained before the save
STEPS_AFTER = 2   # steps DeepSpeed trains after it, whose losses a resumed run must reproduce
DS_WORLD = 2
# name: (stage, optimizer, tied embeddings and a frozen norm)
CASES = {
    "stage1": (1, "adamw", False),
    "stage2": (2, "adamw", False),
    "stage3": (3, "adamw", False),
    "stage2-adagrad": (2, "adagrad", False),
    "stage3-tied-frozen": (3, "adamw", True),
    "stage2-tied-frozen": (2, "adamw", True),
}
STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "adagrad": ("sum",)}
SCRIPT = Path(__file__).with_name("deepspeed_run.py")


def build_model(tied: bool, hidden: int = 32, vocab: int = VOCAB) -> torch.nn.Module:
    """The tiny Llama every case trains (seeded: the same weights on every rank and in every test)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(tied, hidden, vocab))
    if tied:
        model.model.norm.weight.requires_grad_(False)
    return model


def llama_config(tied: bool = False, hidden: int = 32, vocab: int = VOCAB):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def batch(step: int, rank: int, vocab: int = VOCAB) -> torch.Tensor:
    """Data-parallel rank ``rank``'s token ids at ``step`` (2 sequences of 8)."""
    return torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(1000 * step + rank))


def global_batch(step: int, vocab: int = VOCAB) -> torch.Tensor:
    """Every DeepSpeed rank's batch at ``step``, in rank order: what one step of the whole job saw."""
    return torch.cat([batch(step, r, vocab) for r in range(DS_WORLD)])


def write_checkpoints(out: str | os.PathLike, *extra: str, timeout: float = 300) -> None:
    """Run ``deepspeed_run.py`` on 2 gloo ranks (DeepSpeed's CPU accelerator) writing into ``out``."""
    done = run_torchrun(SCRIPT, DS_WORLD, [str(out), *extra], timeout=timeout, env={"DS_ACCELERATOR": "cpu"})
    if done.returncode != 0:
        raise AssertionError(f"deepspeed_run.py failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-6000:]}")
