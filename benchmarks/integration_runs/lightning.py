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

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORLD = 2
STEPS = 3
WIDTH, DEPTH, BATCH = 1024, 4, 16


def measure(engine: str, workdir: str) -> dict:
    """Launch the 2-rank run for ``engine`` in ``workdir``; ``{"save_s", "resume_s", "first_save_s"}``."""
    if engine not in ("default", "shardkit"):
        raise ValueError(f"engine must be 'default' or 'shardkit', got {engine!r}")
    out = Path(workdir) / engine
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           str(Path(__file__).resolve()), engine, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the {engine} Lightning run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads((out / "result.json").read_text())


# -- inside the ranks ------------------------------------------------------------------------------------------

def _ranks(engine: str, out: Path) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy

    import shardkit
    from shardkit.integrations.lightning import ShardkitStrategy

    base = ShardkitStrategy if engine == "shardkit" else ModelParallelStrategy
    timings: dict[str, float] = {}

    def slowest(seconds: float) -> float:
        t = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    class Timed(base):  # the strategy's load, as fit(ckpt_path=...) calls it, timed
        def load_checkpoint(self, *args, **kwargs):
            dist.barrier()
            started = time.perf_counter()
            loaded = super().load_checkpoint(*args, **kwargs)
            timings["resume_s"] = slowest(time.perf_counter() - started)
            return loaded

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
    saves = []
    for i in range(2):
        first.strategy.barrier()
        started = time.perf_counter()
        first.save_checkpoint(str(out / f"ckpt-{i}"))
        saves.append(slowest(time.perf_counter() - started))
    resumed = trainer(STEPS)  # restores, then has no step left to train
    resumed.fit(Model(), ckpt_path=str(out / "ckpt-1"))
    if dist.get_rank() == 0:
        result = {"save_s": saves[1], "first_save_s": saves[0], "resume_s": timings["resume_s"]}
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    # run as a script, this file's folder is sys.path[0], where its own name would hide the lightning package
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    if len(sys.argv) == 3:
        _ranks(sys.argv[1], Path(sys.argv[2]))
    else:
        with tempfile.TemporaryDirectory() as work:
            for name in ("default", "shardkit"):
                print(name, measure(name, work))
