"""Checkpoints written by torch's own FSDP1 load into a shardkit FSDP1 model at
another world size, directly and through ``shardkit convert``.

torch's ``torch.distributed.fsdp.FullyShardedDataParallel`` is imported here
only, as the writer; shardkit code never imports it.  Its ``offload_to_cpu``
full state dict crashes on CPU-only torch, so the writer gathers without it.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardkit.checkpoint as skc
from shardkit import FullyShardedDataParallel as FSDP
from shardkit import StateDictType
from shardkit.cli.main import main as shardkit_cli
from shardkit.wrap import transformer_auto_wrap_policy
from tests.support.dist import run_on_ranks
from tests.support.fsdp1_helpers import build_transformer, torch_fsdp1_writes
from tests.support.models import Block


def _fresh():
    model = FSDP(build_transformer(seed=11), auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(model, optim=None):
    """Full parameters (and optimizer state) on every rank, as plain copies."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        params = {k: v.clone() for k, v in model.state_dict().items()}
    if optim is None:
        return params, None
    osd = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    return params, {fqn: {k: v.clone() for k, v in s.items()} for fqn, s in osd["state"].items()}


def _sharded_loaded_by_shardkit(url: str):
    """A fresh model and optimizer filled from ``url`` by shardkit's loader through FSDP1's
    SHARDED_STATE_DICT surface (format detected: DCP or shardkit's own)."""
    model, optim = _fresh()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
    skc.load(state, url)
    model.load_state_dict(state["model"])
    optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
    return model, optim


def _shardkit_reads(root):
    out = {}
    # 1. the sharded DCP checkpoint, directly with torch.distributed.checkpoint (FSDP1's own recipe)
    model, optim = _fresh()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=os.path.join(root, "sharded"))
        model.load_state_dict(state["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
    out["dcp"] = _full(model, optim)

    # 2. the FULL_STATE_DICT torch.save files, directly
    model, optim = _fresh()
    model.load_state_dict(torch.load(os.path.join(root, "model.pt"), weights_only=True))
    full_osd = torch.load(os.path.join(root, "optim.pt"), weights_only=True) if dist.get_rank() == 0 else None
    optim.load_state_dict(FSDP.scatter_full_optim_state_dict(full_osd, model, optim=optim))
    out["torch_save"] = _full(model, optim)

    # 3. the same two, directly with shardkit's loader (format detected), in place
    model, optim = _sharded_loaded_by_shardkit(os.path.join(root, "sharded"))
    out["skc_dcp"] = _full(model, optim)

    model, _ = _fresh()
    skc.load(skc.get_training_state(model), os.path.join(root, "model.pt"), format="torch")  # live DTensors, in place
    out["skc_torch_save"] = _full(model)

    # 4. both converted to shardkit's format by `shardkit convert` (in the test process), then loaded
    model, optim = _sharded_loaded_by_shardkit(os.path.join(root, "native-from-dcp"))
    out["converted_dcp"] = _full(model, optim)

    model, _ = _fresh()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
    skc.load(state, os.path.join(root, "native-from-pt"))
    model.load_state_dict(state["model"])
    out["converted_pt"] = _full(model)

    # 5. the full_optim_state_dict file converted too (optimizer state, not weights), next to the weights
    model, optim = _fresh()
    state = skc.get_training_state(model, optim)  # live DTensors; a fresh optimizer's state is created first
    skc.load({"model": state["model"]}, os.path.join(root, "native-from-pt"))
    skc.load({"optim": state["optim"]}, os.path.join(root, "native-from-optim-pt"))
    skc.set_training_state(model, optim, state)
    out["converted_pt_and_optim_pt"] = _full(model, optim)
    return out


def test_torch_fsdp1_checkpoints_at_two_ranks_load_into_shardkit_at_three(tmp_path):
    root = str(tmp_path)
    run_on_ranks(2, torch_fsdp1_writes, root)
    for src, dst in (("sharded", "native-from-dcp"), ("model.pt", "native-from-pt"),
                     ("optim.pt", "native-from-optim-pt")):
        with pytest.raises(SystemExit) as exited:  # the `shardkit` command, in this process
            shardkit_cli(["-q", "convert", str(tmp_path / src), str(tmp_path / dst), "--to", "shardkit"])
        assert exited.value.code == 0
    saved_model = torch.load(tmp_path / "model.pt", weights_only=True)
    saved_optim = torch.load(tmp_path / "optim.pt", weights_only=True)["state"]
    assert "layers.0.attention.wq.weight" in saved_model and len(saved_optim) == len(saved_model)

    for result in run_on_ranks(3, _shardkit_reads, root):
        for path, (params, optim_state) in result.items():
            assert params.keys() == saved_model.keys(), path
            for key, value in saved_model.items():
                assert torch.equal(params[key], value), (path, key)
            if optim_state is None:
                continue
            assert optim_state.keys() == saved_optim.keys(), path
            for fqn, values in saved_optim.items():
                for name, value in values.items():
                    assert torch.equal(optim_state[fqn][name], value), (path, fqn, name)
