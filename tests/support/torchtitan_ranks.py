"""What each rank runs in tests/integrations/test_torchtitan.py: trainer runs that save, stop and resume.

Each function takes the test's folder, runs on every rank of a gloo group
(``run_on_ranks``), and returns what the test compares: losses per step (the
global mean, as torchtitan logs it), restored steps, folder listings.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from tests.support.torchtitan_seam import STEPS, Run, full_state


def shardkit_config(**options: Any) -> Any:
    from shardkit.integrations.torchtitan import ShardkitCheckpointManager

    defaults = {"enable": True, "folder": "ckpt", "interval": 2, "keep_latest_k": 0, "last_save_model_only": False}
    return ShardkitCheckpointManager.Config(**{**defaults, **options})


def uninterrupted(root: str, **options: Any) -> list[float]:
    """Every step's loss of a run that never stops (its own folder, saving as the others do)."""
    run = Run(shardkit_config(**options), os.path.join(root, "uninterrupted"))
    try:
        return run.train(STEPS)
    finally:
        run.close()


def stop_and_resume(root: str, stop: int, **options: Any) -> dict[str, Any]:
    """Train to ``stop`` and close (the job ends); a new job on the same folder resumes and finishes."""
    full = uninterrupted(root, **options)
    first = Run(shardkit_config(**options), os.path.join(root, "run"))
    first.train(stop)
    first.close()
    dist.barrier()
    second = Run(shardkit_config(**options), os.path.join(root, "run"))
    restored_losses = second.train(STEPS)
    out = {"full": full, "resumed": restored_losses, "staging": second.checkpointer.staging_future,
           "listing": sorted(os.listdir(os.path.join(root, "run", "ckpt")))}
    second.close()
    return out


def save_at_two(root: str) -> list[float]:
    """2 ranks: train 6 steps saving every 2; the losses."""
    run = Run(shardkit_config(), os.path.join(root, "run"))
    losses = run.train(STEPS)
    run.close()
    return losses


def resume_alone(root: str, step: int) -> tuple[int, list[float]]:
    """1 rank: resume ``step`` of the 2-rank run (data position excluded: it is per data-parallel rank)."""
    run = Run(shardkit_config(load_step=step, exclude_from_loading=["dataloader"]), os.path.join(root, "run"))
    losses = run.train(STEPS, load_step=step, reposition=True)
    run.close()
    return step, losses


def crash_leftovers(root: str) -> dict[str, Any]:
    """Train to 4 (steps 2 and 4 saved), then leave what crashed saves of steps 6 and 8 leave: shardkit
    data files without their manifest, DCP shards without ``.metadata``; a new job resumes."""
    full = uninterrupted(root)
    folder = os.path.join(root, "run", "ckpt")
    first = Run(shardkit_config(), os.path.join(root, "run"))
    first.train(4)
    first.close()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(folder, "step-4", "data"), os.path.join(folder, "step-6", "data"))
        os.makedirs(os.path.join(folder, "step-8"))
        with open(os.path.join(folder, "step-8", "__0_0.distcp"), "wb") as f:
            f.write(b"\0" * 64)
    dist.barrier()
    second = Run(shardkit_config(keep_latest_k=2), os.path.join(root, "run"))
    second.checkpointer.load()
    restored = second.train_state.step
    losses = second.train(STEPS, load=False)
    second.close()
    return {"full": full, "restored": restored, "resumed": losses, "listing": sorted(os.listdir(folder))}


def load_step_honoured(root: str) -> dict[str, Any]:
    """Steps 2, 4, 6 saved; a job asking for step 2 resumes it although 6 is newer."""
    full = uninterrupted(root)
    run = Run(shardkit_config(), os.path.join(root, "run"))
    run.train(STEPS)
    run.close()
    again = Run(shardkit_config(load_step=2), os.path.join(root, "run"))
    losses = again.train(STEPS, load_step=2)
    restored = [s + 1 for s in range(2, STEPS)]
    again.close()
    return {"full": full, "resumed": losses, "steps": restored}


def dcp_then_shardkit(root: str, with_dataloader: bool) -> dict[str, Any]:
    """torchtitan's own DCP manager saves step 2 (``with_dataloader``: with its data position, which it
    pickles); ShardkitCheckpointManager resumes it and saves on."""
    from torchtitan.components.checkpointer import CheckpointManager

    full = uninterrupted(root)
    dcp_config = CheckpointManager.Config(enable=True, folder="ckpt", interval=2, keep_latest_k=0,
                                          last_save_model_only=False)
    first = Run(dcp_config, os.path.join(root, "run"), checkpoint_dataloader=with_dataloader)
    first.train(3)
    first.close()
    dist.barrier()
    second = Run(shardkit_config(), os.path.join(root, "run"))
    losses = second.train(4, reposition=True)  # a DCP step's data position is not read
    second.close()
    third = Run(shardkit_config(), os.path.join(root, "run"))
    losses += third.train(STEPS)
    third.close()
    return {"full": full, "resumed": losses}


def final_exports(root: str, hf_adapter: Any = None) -> dict[str, Any]:
    """A run whose last step saves the model only, in bf16 (and as an HF folder with an adapter)."""
    options = {"last_save_model_only": True, "export_dtype": "bfloat16", "last_save_in_hf": hf_adapter is not None}
    run = Run(shardkit_config(**options), os.path.join(root, "run"), sd_adapter=hf_adapter)
    run.train(STEPS)
    weights = full_state(run)
    run.close()
    return {name: t.to(torch.bfloat16) for name, t in weights.items()}


def initial_load(root: str, path: str, model_only: bool, hf_adapter: Any = None) -> dict[str, Any]:
    """A fresh folder and ``initial_load_path``: what the job starts from."""
    config = shardkit_config(initial_load_path=path, initial_load_model_only=model_only,
                             initial_load_in_hf=hf_adapter is not None)
    run = Run(config, os.path.join(root, "fresh-" + os.path.basename(path)), seed=7, sd_adapter=hf_adapter)
    loaded = run.checkpointer.load()
    out = {"loaded": loaded, "weights": full_state(run), "step": run.train_state.step,
           "optimizer_state": len(run.optimizers.optimizers[0].state)}
    run.close()
    return out


def retention(root: str) -> dict[str, Any]:
    """keep_latest_k=2 with a save every step: rank 0 alone removes the older steps."""
    run = Run(shardkit_config(interval=1, keep_latest_k=2), os.path.join(root, "run"))
    run.train(STEPS)
    run.close()
    dist.barrier()
    return {"listing": sorted(os.listdir(os.path.join(root, "run", "ckpt")))}
