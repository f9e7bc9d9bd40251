"""torchtitan's trainer, piece by piece, as ``Trainer.__init__`` and ``Trainer.train_step`` build and run it.

torchtitan 0.3's trainer does not run on a CPU-only torch: importing
``torchtitan.trainer`` imports ``torchtitan/distributed/minimal_async_ep/kernels.py``,
whose line 10 is ``import triton`` (triton ships with CUDA builds of torch only),
and past that ``Trainer.__init__`` (``torchtitan/trainer.py`` line 301) calls
``device_module.set_device`` on ``torch.cuda`` -- ``torchtitan/tools/utils.py``
line 55 picks ``"cuda"`` when no accelerator is found.  So the tests drive the
checkpoint seam with torchtitan's real objects, built the way the trainer builds
them: a model sharded by FSDP2 (torchtitan's ``fully_shard``), torchtitan's
``OptimizersContainer`` (AdamW, ``default_adamw``), ``LRSchedulersContainer``
(warmup + linear decay, as the debug model config), a ``ParallelAwareDataloader``
over a stateful dataset, the ``train_state`` (the trainer's ``step`` and
``ntokens_seen``), and the manager built from its config by ``config.build(...)``
with the trainer's keyword arguments.  Each step is the trainer's: zero grads,
forward, loss, backward, optimizer step, scheduler step, ``checkpointer.save``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from tests.support.models import ModelArgs, Transformer

ARGS = ModelArgs(vocab_size=37, dim=26, n_layers=2, max_seq_len=8)
GLOBAL_BATCH = 4   # samples per step over all data-parallel ranks
STEPS = 6


class TokenStream(IterableDataset, Stateful):
    """Sample ``i`` is a fixed random sequence; data-parallel rank ``r`` of ``dp`` reads ``r, r + dp, ...``,
    so a step's global batch is the same samples at any width.  ``state_dict`` is what torchtitan's
    HuggingFace datasets keep: the index of the next sample."""

    def __init__(self, dp_rank: int, dp_world_size: int, start: int = 0) -> None:
        self.dp_rank, self.dp_world_size, self.sample_idx = dp_rank, dp_world_size, start

    def __iter__(self):
        while True:
            gen = torch.Generator().manual_seed(1000 + self.sample_idx * self.dp_world_size + self.dp_rank)
            data = torch.randint(0, ARGS.vocab_size, (ARGS.max_seq_len + 1,), generator=gen)
            self.sample_idx += 1
            yield {"input": data[:-1]}, data[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sample_idx = state_dict["sample_idx"]


class TrainState(Stateful):
    """The trainer's own checkpointed state (``Trainer.state_dict``: ``step`` and ``ntokens_seen``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


class PrefixAdapter:
    """A state-dict adapter as torchtitan's models have (``to_hf``/``from_hf``): HF names are
    ``model.<fqn>`` here, as Llama's are ``model.layers...`` for torchtitan's ``layers...``."""

    hf_assets_path = None
    fqn_to_index_mapping = None

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model."): v for k, v in hf_state_dict.items()}


class Run:
    """One trainer: its components and its checkpointer, built as ``Trainer.__init__`` builds them."""

    def __init__(self, checkpoint_config: Any, dump_folder: str, *, seed: int = 0, steps: int = STEPS,
                 sd_adapter: Any = None, checkpoint_dataloader: bool = True) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.manual_seed(seed)
        model = Transformer(ARGS)
        if dist.is_initialized():
            mesh = init_device_mesh("cpu", (world,))
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model_parts = [model]
        self.optimizers = default_adamw(lr=1e-2).build(model_parts=self.model_parts)
        self.lr_schedulers = LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0,
        ).build(optimizers=self.optimizers, training_steps=steps)
        self.dataset = TokenStream(rank, world)
        self.dataloader = ParallelAwareDataloader(self.dataset, dp_rank=rank, dp_world_size=world,
                                                  batch_size=GLOBAL_BATCH // world)
        self.train_state = TrainState()
        self.checkpointer = checkpoint_config.build(
            dataloader=self.dataloader if checkpoint_dataloader else None, model_parts=self.model_parts,
            optimizers=self.optimizers, lr_schedulers=self.lr_schedulers, states={"train_state": self.train_state},
            sd_adapter=sd_adapter, base_folder=dump_folder)
        self._batches = None

    def train(self, until: int, *, total: int = STEPS, load: bool = True, load_step: int = -1,
              reposition: bool = False) -> list[float]:
        """``Trainer.train``: load, then steps up to ``until`` with a save after each; the global mean losses.

        ``reposition``: put the data where the restored step says (a resume at another width, whose
        data loader position is excluded from loading)."""
        if load:
            self.checkpointer.load(step=load_step)
        if reposition:
            self.dataset.sample_idx = self.train_state.step * GLOBAL_BATCH // self.dataloader.dp_world_size
        losses = []
        while self.train_state.step < until:
            self.train_state.step += 1
            losses.append(self.train_step())
            self.checkpointer.save(self.train_state.step, last_step=self.train_state.step == total)
        self.checkpointer.maybe_wait_for_staging()
        return losses

    def train_step(self) -> float:
        if self._batches is None:
            self._batches = iter(self.dataloader)
        inputs, labels = next(self._batches)
        self.optimizers.zero_grad()
        logits = self.model_parts[0](inputs["input"])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.train_state.ntokens_seen += labels.numel()
        global_loss = loss.detach().clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        return float(global_loss)

    def close(self) -> None:
        self.checkpointer.close()


def full_state(run: Run) -> dict[str, torch.Tensor]:
    """Every parameter, whole, on every rank (for comparisons)."""
    out = {}
    for name, param in run.model_parts[0].named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = full.detach().clone()
    return out
