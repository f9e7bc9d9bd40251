"""Lightning's save and resume time: its own ``ModelParallelStrategy`` (torch DCP) against ``ShardkitStrategy``.

``measure(engine, workdir)`` (engine ``"default"`` or ``"shardkit"``) launches 2 gloo ranks under torchrun
running this file: ``Trainer.fit`` trains the same MLP (4 x 1024x1024 linear layers: 16.8 MB of weights,
50 MB with Adam's two moments) for the same steps, then ``trainer.save_checkpoint`` saves it twice (the
second, with warm caches and started writers, is ``save_s``; the first is ``first_save_s``), and a new
``Trainer`` resumes it with ``fit(ckpt_path=...)`` (``resume_s``: the strategy's ``load_checkpoint``, which
reads the checkpoint into the set-up model and optimizer).  Each is timed inside the ranks, after a
barrier, and the slowest rank's time is reported.  Both saves are synchronous: the time until the
checkpoint is committed.

    python benchmarks/integration_runs/lightning.py            # both engines, printed side by side
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.integration_launch import launch, run_as_script, slowest_rank_seconds, write_result  # noqa: E402

WORLD = 2
STEPS = 3
WIDTH, DEPTH, BATCH = 1024, 4, 16


def measure(engine: str, workdir: str) -> dict:
    """Launch the 2-rank run for ``engine`` in ``workdir``; ``{"save_s", "resume_s", "first_save_s"}``."""
    return launch(__file__, "Lightning", engine, workdir, nproc=WORLD)


# -- inside the ranks ------------------------------------------------------------------------------------------

def _ranks(engine: str, workdir: str) -> None:
    import lightning as L
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy

    import shardkit
    from shardkit.integrations.lightning import ShardkitStrategy

    base = ShardkitStrategy if engine == "shardkit" else ModelParallelStrategy
    timings: dict[str, float] = {}

    class Timed(base):  # the strategy's load, as fit(ckpt_path=...) calls it, timed
        def load_checkpoint(self, *args, **kwargs):
            loaded = {}
            timings["resume_s"] = slowest_rank_seconds(
                lambda: loaded.update(value=super(Timed, self).load_checkpoint(*args, **kwargs)))
            return loaded["value"]

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(DEPTH)])

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            shard = shardkit.fully_shard if engine == "shardkit" else torch.distributed.fsdp.fully_shard
            for block in self.net:
                shard(block, mesh=mesh)
            shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, = batch
            return F.mse_loss(self.net(x), x)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(STEPS * BATCH, WIDTH, generator=torch.Generator()))
            return torch.utils.data.DataLoader(data, batch_size=BATCH)

    def trainer(max_steps: int):
        sizes = {"data_parallel_size": WORLD, "tensor_parallel_size": 1}
        return L.Trainer(accelerator="cpu", devices=WORLD, strategy=Timed(**sizes), max_steps=max_steps,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)

    first = trainer(STEPS)
    first.fit(Model())
    saves = [slowest_rank_seconds(lambda: first.save_checkpoint(os.path.join(workdir, f"ckpt-{i}")))
             for i in range(2)]
    resumed = trainer(STEPS)  # restores, then has no step left to train
    resumed.fit(Model(), ckpt_path=os.path.join(workdir, "ckpt-1"))
    write_result(workdir, {"save_s": saves[1], "first_save_s": saves[0], "resume_s": timings["resume_s"]})


if __name__ == "__main__":
    run_as_script(__file__, _ranks, measure)
