"""``inspect`` of checkpoints other tools wrote: a DCP directory reports its model and optimizer bytes however
its keys nest them (torch's recipe nests both in a ``Stateful`` ``AppState``) and the world size that wrote it;
a torch.save file that needs ``--trust-pickle`` is inspected with it, as its refusal says."""

from __future__ import annotations

import argparse

import pytest
import torch

from shardkit.checkpoint.offline.convert import inspect
from tests.support.formats_helpers import torch_fully_shard_dcp
from tests.support.models import ModelArgs, Transformer
from tests.support.offline_cli import run_cli


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = Transformer(ModelArgs())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.arange(8)[None]).sum().backward()
    opt.step()
    return model, opt


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("nesting", ["app-state", "model-and-optim", "bare-model-and-optimizer"])
def test_inspect_of_a_dcp_counts_model_and_optimizer_bytes_however_they_nest(tmp_path, nesting):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    state = {"app-state": {"app": {"model": msd, "optim": osd}},
             "model-and-optim": {"model": msd, "optim": osd},
             "bare-model-and-optimizer": {**msd, "optimizer": osd}}[nesting]
    dcp.save(state, checkpoint_id=str(tmp_path / "d"), no_dist=True)

    totals = inspect(str(tmp_path / "d"))["totals"]

    assert totals["model_bytes"] == _nbytes(msd.values())
    assert totals["optim_bytes"] == _nbytes(v for per_param in osd["state"].values() for v in per_param.values())
    assert totals["bytes"] == totals["model_bytes"] + totals["optim_bytes"]


def test_inspect_of_a_dcp_saved_at_two_ranks_prints_its_world_size_and_byte_split():
    path, flat, _ = torch_fully_shard_dcp()
    result = run_cli("inspect", path)
    assert result.exit_code == 0, result.stderr
    model = _nbytes(v for k, v in flat.items() if k.startswith("model."))
    assert "layout: world size 2" in result.stdout
    total_line = result.stdout.strip().splitlines()[-1]
    assert "model 0 B" not in total_line and "optimizer 0 B" not in total_line
    assert inspect(path)["totals"]["model_bytes"] == model


def test_inspect_takes_trust_pickle_as_its_refusal_tells_the_user(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.ones(2, 3)}, "args": argparse.Namespace(lr=0.1)}, path)

    refused = run_cli("inspect", str(path))
    assert refused.exit_code == 1 and "pass --trust-pickle" in refused.stderr

    trusted = run_cli("inspect", str(path), "--trust-pickle")
    assert trusted.exit_code == 0, trusted.stderr
    assert "model.w" in trusted.stdout and "2x3" in trusted.stdout
