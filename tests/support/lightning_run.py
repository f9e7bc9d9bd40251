"""Lightning runs for tests/integrations/test_lightning.py, launched under torchrun (``Trainer.fit`` on gloo).

``python -m torch.distributed.run --nproc_per_node W tests/support/lightning_run.py WORKDIR OUT CASE...``
runs each case in order in the same processes (one launch, several ``Trainer``s) and rank 0 writes OUT:
``{case: {...}}`` with, per fit, the records of every step (the global batch's sample indices and the
global-mean loss as ``float.hex``) and what the case observed on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import fsspec
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

import shardkit  # noqa: E402
from shardkit.data import ElasticLoader, ElasticSampler  # noqa: E402
from shardkit.integrations.lightning import ShardkitFabricStrategy, ShardkitStrategy  # noqa: E402

NUM_SAMPLES, GLOBAL_BATCH, SEED = 48, 12, 5  # 4 global batches an epoch
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


from tests.support.data_helpers import IndexedRegression  # noqa: E402 - the repository root is on sys.path above


def Samples() -> IndexedRegression:  # noqa: N802 - named as the dataset it builds
    """The seeded regression set shared with tests/checkpoint/training/test_resume_exact.py, at this run's size."""
    return IndexedRegression(NUM_SAMPLES)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def shard(net: nn.Module, mesh, engine: str) -> nn.Module:
    fully_shard = shardkit.fully_shard if engine == "shardkit" else torch.distributed.fsdp.fully_shard
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def global_record(indices: torch.Tensor, loss: torch.Tensor) -> list:
    """(the global batch's sample indices, the global-mean loss as float.hex), the same on every rank."""
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, indices.tolist())
    return [[i for part in parts for i in part], mean.item().hex()]


class Regression(L.LightningModule):
    """The tiny model every fit trains; its data position rides in the checkpoint through its hooks."""

    def __init__(self, engine: str = "shardkit") -> None:
        super().__init__()
        self.net = mlp()
        self.engine = engine
        self.records: list = []
        self.sampler: ElasticSampler | None = None
        self.sampler_state = None
        self.sharded = False

    def configure_model(self) -> None:
        if not self.sharded:  # a later validate() calls it again on the same module
            shard(self.net, self.device_mesh["data_parallel"], self.engine)
            self.sharded = True

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        loss = F.mse_loss(self.net(x), y)  # equal shares, and gradients are averaged: the global batch's mean
        record = global_record(index, loss)
        self.records.append(record)
        self.log("train_loss", float.fromhex(record[1]), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        index, x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        self.sampler = ElasticSampler(NUM_SAMPLES, global_batch_size=GLOBAL_BATCH, seed=SEED)
        if self.sampler_state is not None:
            self.sampler.load_state_dict(self.sampler_state)
        return ElasticLoader(Samples(), batch_sampler=self.sampler)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["sampler"] = self.sampler.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.sampler_state = checkpoint["sampler"]


def fit(engine: str, dirpath: str, epochs: int, *, ckpt_path=None, strategy=None, top_k: int = 1,
        model: Regression | None = None, max_steps: int = -1, **checkpoint_kw) -> Regression:
    if strategy is None:
        strategy = (ShardkitStrategy() if engine == "shardkit"
                    else ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1))
    model = model or Regression(engine)
    callback = ModelCheckpoint(**{"dirpath": dirpath, "monitor": "train_loss", "save_top_k": top_k,
                                  "save_last": True, **checkpoint_kw})  # save_last="link" in checkpoint_kw too
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=epochs, max_steps=max_steps,
                        logger=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[callback])
    trainer.fit(model, ckpt_path=ckpt_path)
    model.trainer_seen = {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                          "lr": trainer.optimizers[0].param_groups[0]["lr"],
                          "best": callback.best_model_path, "last": callback.last_model_path}
    return model


def listing(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def case_resume(work: Path, engine: str) -> dict:
    """Two epochs straight; one epoch, stop, then fit(ckpt_path="last") for the second."""
    straight = fit(engine, str(work / f"{engine}-straight"), 2)
    first = fit(engine, str(work / f"{engine}-stopped"), 1)
    if dist.get_rank() == 0:  # the epoch-1 checkpoint as it was, for the cases that resume it elsewhere
        shutil.copytree(work / f"{engine}-stopped" / "last.ckpt", work / f"{engine}-epoch1")
    dist.barrier()
    resumed = fit(engine, str(work / f"{engine}-stopped"), 2, ckpt_path="last")
    # trainer.validate(ckpt_path=...) loads the model alone (no optimizer) into a fresh one
    loader = ElasticLoader(Samples(), batch_sampler=ElasticSampler(NUM_SAMPLES, global_batch_size=GLOBAL_BATCH))
    in_memory = straight.trainer.validate(straight, dataloaders=loader, verbose=False)
    validator = L.Trainer(accelerator="cpu", devices=WORLD, strategy=straight.trainer.strategy.__class__(
        **({} if engine == "shardkit" else {"data_parallel_size": WORLD, "tensor_parallel_size": 1})),
        logger=False, enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    from_file = validator.validate(Regression(engine), dataloaders=loader, verbose=False,
                                   ckpt_path=str(work / f"{engine}-straight" / "last.ckpt"))
    return {"straight": straight.records, "first": first.records, "resumed": resumed.records,
            "seen": resumed.trainer_seen, "files": listing(str(work / f"{engine}-stopped")),
            "validate": [in_memory[0]["val_loss"], from_file[0]["val_loss"]]}


def case_dcp_into_shardkit(work: Path) -> dict:
    """Lightning's own DCP 'last.ckpt' (written by case_resume's reference run) resumed by ShardkitStrategy."""
    resumed = fit("shardkit", str(work / "dcp-into-shardkit"), 2,
                  ckpt_path=str(work / "reference-epoch1"))
    return {"resumed": resumed.records, "seen": resumed.trainer_seen}


def case_mid_epoch(work: Path) -> dict:
    """A checkpoint every 2 steps, stopped at step 6 (the middle of epoch 1), resumed with ckpt_path="last"."""
    dirpath = str(work / "mid-epoch")
    first = fit("shardkit", dirpath, 2, max_steps=6, monitor=None, every_n_train_steps=2)
    resumed = fit("shardkit", dirpath, 2, ckpt_path="last", monitor=None, every_n_train_steps=2)
    return {"first": first.records, "resumed": resumed.records, "seen": resumed.trainer_seen}


def case_link(work: Path) -> dict:
    """save_last="link": last.ckpt is a link to the newest top-k checkpoint; fit(ckpt_path="last") follows it."""
    dirpath = work / "link"
    first = fit("shardkit", str(dirpath), 2, save_last="link")
    link = {"is_link": (dirpath / "last.ckpt").is_symlink(), "target": os.readlink(dirpath / "last.ckpt")}
    resumed = fit("shardkit", str(dirpath), 3, save_last="link", ckpt_path="last")
    return {"first": first.records, "resumed": resumed.records, "link": link, "files": listing(str(dirpath)),
            "final_target": os.readlink(dirpath / "last.ckpt")}


def case_top_k(work: Path) -> dict:
    """save_top_k=2 over 4 epochs (the loss falls every epoch): the two newest stay, with last."""
    dirpath = str(work / "top-k")
    model = fit("shardkit", dirpath, 4, top_k=2)
    return {"files": listing(dirpath), "seen": model.trainer_seen, "records": model.records}


def case_path_and_url(work: Path, url: str) -> dict:
    """trainer.save_checkpoint to a URL (async save), then fit(ckpt_path=<that URL>) and fit(ckpt_path=<a path>).

    ``memory://`` is one process's own store: it holds a whole checkpoint only at world size 1.
    """
    model = fit("shardkit", str(work / "path-a"), 1, strategy=ShardkitStrategy(async_save=True))
    model.trainer.save_checkpoint(url)
    model.trainer.strategy.store.wait()
    fs, root = fsspec.core.url_to_fs(url)
    stored = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    from_url = fit("shardkit", str(work / "path-b"), 2, ckpt_path=url)
    from_path = fit("shardkit", str(work / "path-c"), 2, ckpt_path=str(work / "path-a" / "last.ckpt"))
    return {"first": model.records, "url_files": stored, "from_url": from_url.records,
            "from_path": from_path.records, "seen": from_url.trainer_seen}


def case_managed(work: Path) -> dict:
    """keep_last=2 with the hot tier (local=), saved in the background: 3 epochs; then fit(ckpt_path="last")
    resumes from the hot tier."""
    dirpath, hot = str(work / "managed"), str(work / "hot" / "node{node}")
    strategy = ShardkitStrategy(keep_last=2, local=hot, async_save=True)
    fit("shardkit", dirpath, 3, strategy=strategy, top_k=1)
    after_fit = listing(dirpath)
    hot_files = sorted(str(p.relative_to(work / "hot")) for p in (work / "hot").rglob("manifest.json"))
    strategy = ShardkitStrategy(keep_last=2, local=hot)
    resumed = fit("shardkit", dirpath, 4, strategy=strategy, ckpt_path="last")
    last = strategy.store.last_load(str(Path(dirpath) / "last.ckpt"))
    return {"files": after_fit, "hot": hot_files, "resumed": resumed.records, "seen": resumed.trainer_seen,
            "source": None if last is None else last.source}


def case_s3(work: Path) -> dict:
    """ModelCheckpoint's folder in a bucket (S3_URL, S3_OPTIONS): one epoch, then fit(ckpt_path=<s3 URL>) for the
    second; top-k removes the bucket's epoch-0 checkpoint."""
    url, options = os.environ["S3_URL"], json.loads(os.environ["S3_OPTIONS"])
    fs, root = fsspec.core.url_to_fs(url, **options)

    def names() -> list[str]:
        fs.invalidate_cache()
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))

    first = fit("shardkit", url, 1, strategy=ShardkitStrategy(storage_options=options))
    after_first = names()
    resumed = fit("shardkit", url, 2, strategy=ShardkitStrategy(storage_options=options),
                  ckpt_path=f"{url}/last.ckpt")
    return {"first": first.records, "resumed": resumed.records, "after_first": after_first, "after": names()}


def case_dedup(work: Path) -> dict:
    """dedup=True with the first layer frozen: a later step references the frozen weights instead of writing them."""
    dirpath = str(work / "dedup")
    model = Regression()
    model.net[0].requires_grad_(False)
    fit("shardkit", dirpath, 2, model=model, strategy=ShardkitStrategy(keep_last=2, dedup=True))

    def stored(step: str) -> int:
        return sum(f.stat().st_size for f in (Path(dirpath) / step / "data").iterdir())

    return {"files": listing(dirpath), "bytes": [stored("step-0000000004"), stored("step-0000000008")],
            "records": model.records}


def case_fabric(work: Path) -> dict:
    """fabric.save/fabric.load round trip: local shards and optimizer state bitwise, other values back."""
    fabric = L.Fabric(accelerator="cpu", devices=WORLD,
                      strategy=ShardkitFabricStrategy(lambda m, mesh: shard(m, mesh["data_parallel"], "shardkit")))
    fabric.launch()
    model = fabric.setup_module(mlp())
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    data = Samples()
    for step in range(2):
        loss = F.mse_loss(model(data.x[step * 4:(step + 1) * 4]), data.y[step * 4:(step + 1) * 4])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    path = str(work / "fabric" / "ckpt")
    fabric.save(path, {"model": model, "optimizer": opt, "step": 2, "note": {"lr": (1e-2, None)}})
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].to_local().clone() for s in opt.optimizer.state.values()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fresh_opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": fresh_opt, "step": 0}
    remainder = fabric.load(path, state)
    after = {k: v.to_local() for k, v in model.state_dict().items()}
    fresh_moments = [s["exp_avg"].to_local() for s in fresh_opt.optimizer.state.values()]
    return {"weights_equal": all(torch.equal(before[k], after[k]) for k in before),
            "moments_equal": len(moments) == len(fresh_moments) and all(
                torch.equal(a, b) for a, b in zip(moments, fresh_moments)),
            "step": state["step"], "remainder": repr(remainder)}


CASES = {
    "resume": lambda work: case_resume(work, "shardkit"),
    "reference": lambda work: case_resume(work, "reference"),
    "dcp_into_shardkit": case_dcp_into_shardkit,
    "top_k": case_top_k,
    "mid_epoch": case_mid_epoch,
    "link": case_link,
    "path_and_url": lambda work: case_path_and_url(work, (work / "saved-by-url").as_uri()),
    "memory": lambda work: case_path_and_url(work, "memory://lightning/epoch1"),
    "managed": case_managed,
    "fabric": case_fabric,
    "s3": case_s3,
    "dedup": case_dedup,
    "resume_other_size": lambda work: {"resumed": fit(
        "shardkit", str(work / "other-size"), 2, ckpt_path=str(work / "shardkit-epoch1")).records},
}


def main() -> None:
    work, out, cases = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    results = {}
    for case in cases:
        results[case] = CASES[case](work)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
