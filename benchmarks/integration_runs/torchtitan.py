"""torchtitan's checkpoint seam: its DCP ``CheckpointManager`` vs ``ShardkitCheckpointManager``, same state.

``measure(engine, workdir)`` launches 2 gloo ranks under torchrun running this
file.  torchtitan 0.3's trainer does not start on a CPU-only torch (importing
``torchtitan.trainer`` reaches ``import triton`` in
``torchtitan/distributed/minimal_async_ep/kernels.py``; see
tests/support/torchtitan_seam.py), so each rank builds what ``Trainer.__init__``
builds: a model of about 4.4 M parameters sharded by FSDP2 (with AdamW's two
moments about 53 MB of state), torchtitan's ``OptimizersContainer`` (AdamW) and
``LRSchedulersContainer``, a ``ParallelAwareDataloader`` and the train state,
trains one step so the optimizer has its state, and builds the checkpoint
manager from its config with the trainer's arguments -- ``engine`` ``default``
(torchtitan's DCP ``CheckpointManager``) or ``shardkit``.  Then:

* a save of step 1 (what a job's first save pays once, for either engine),
* times ``checkpointer.save(2)`` (synchronous, ``async_mode="disabled"``),
* times ``checkpointer.load(step=2)`` into the live model, optimizer and schedule.

Each time is the slowest rank's (a barrier before, an all-reduce of the maxima
after).  Returns ``{"save_s": ..., "resume_s": ...}``.

    python benchmarks/integration_runs/torchtitan.py   # one measurement of each engine
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.integration_launch import launch, run_as_script, slowest_rank_seconds, write_result  # noqa: E402

DIM, FFN, LAYERS, VOCAB = 256, 1024, 5, 1000  # 4.4 M parameters


def measure(engine: str, workdir: str) -> dict:
    """The slowest rank's ``save`` and ``load`` seconds with ``engine`` on 2 gloo ranks."""
    return launch(__file__, "torchtitan", engine, workdir)


def _model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.Linear(DIM, 4 * DIM, bias=False)
            self.proj = nn.Linear(4 * DIM, DIM, bias=False)
            self.w1 = nn.Linear(DIM, FFN, bias=False)
            self.w2 = nn.Linear(FFN, DIM, bias=False)
            self.norm = nn.LayerNorm(DIM)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            h = h + self.proj(torch.relu(self.attention(self.norm(h))))
            return h + self.w2(torch.relu(self.w1(h)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
            self.output = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h)
            return self.output(h)

    return Model()


class _Tokens:
    """A stateful stream of random tokens (what torchtitan's datasets keep: the next sample's index)."""

    def __init__(self) -> None:
        self.sample_idx = 0

    def __iter__(self):
        import torch

        while True:
            gen = torch.Generator().manual_seed(self.sample_idx)
            data = torch.randint(0, VOCAB, (17,), generator=gen)
            self.sample_idx += 1
            yield {"input": data[:-1]}, data[1:]

    def state_dict(self) -> dict:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state: dict) -> None:
        self.sample_idx = state["sample_idx"]


class _TrainState:
    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def _rank(engine: str, workdir: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import IterableDataset
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from shardkit.integrations.torchtitan import ShardkitCheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    dataset = type("Stream", (_Tokens, IterableDataset), {})()
    dataloader = ParallelAwareDataloader(dataset, dp_rank=rank, dp_world_size=world, batch_size=2)
    inputs, labels = next(iter(dataloader))
    logits = model(inputs["input"])
    F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    optimizers.step()
    schedulers.step()
    config_class = ShardkitCheckpointManager.Config if engine == "shardkit" else CheckpointManager.Config
    config = config_class(enable=True, folder="ckpt", interval=1, keep_latest_k=0, last_save_model_only=False)
    train_state = _TrainState()
    checkpointer = config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=schedulers, states={"train_state": train_state}, sd_adapter=None,
                                base_folder=workdir)
    checkpointer.save(1)  # the first save of a job: either engine's one-off costs

    save_s = slowest_rank_seconds(lambda: checkpointer.save(2))
    resume_s = slowest_rank_seconds(lambda: checkpointer.load(step=2))
    checkpointer.close()
    write_result(workdir, {"save_s": save_s, "resume_s": resume_s})


if __name__ == "__main__":
    run_as_script(__file__, _rank, measure)
