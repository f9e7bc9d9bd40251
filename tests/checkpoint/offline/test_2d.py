"""A 2-D checkpoint offline: full state dicts and ``convert --to hf`` equal the single-process model
bitwise, ``reshard`` to a 1-D world size resumes bitwise, ``inspect`` shows the saved mesh and placements."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.support.checkpoint_2d_helpers import (
    LAYOUTS,
    TPNet,
    build,
    mismatches,
    on_rank0,
    rel_close,
    resume,
    run_layout,
    train_save_continue,
)
from tests.support.offline_cli import run_cli


def _full_model_state_at_2x2():
    from shardkit.checkpoint.state.full_state_dict import get_full_state_dict

    model = build("torch", LAYOUTS["dp2tp2"], seed=7)
    return on_rank0({k: v.clone() for k, v in get_full_state_dict(model).get("model", {}).items()})


def test_full_state_dict_of_a_2x2_model_is_the_single_process_model_bitwise():
    full = run_layout("dp2tp2", _full_model_state_at_2x2)
    torch.manual_seed(7)
    single = TPNet().state_dict()
    assert sorted(full) == sorted(single)
    assert all(torch.equal(full[k], single[k]) for k in single)


@pytest.fixture(scope="module")
def saved_2d(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("offline2d") / "dp2tp2")
    return url, run_layout("dp2tp2", train_save_continue, url, "torch", "dp2tp2")


def test_convert_to_hf_of_a_2x2_checkpoint_is_the_single_process_model_bitwise(saved_2d, tmp_path):
    import shardkit.checkpoint as skc

    url, reference = saved_2d
    single = TPNet()  # one process, plain tensors, loaded from the 2-D checkpoint
    sd = skc.get_training_state(single)
    skc.load(sd, url, strict=False)
    skc.set_training_state(single, None, sd)
    gathered = {k.removeprefix("model."): v for k, v in reference["saved"]["tensors"].items() if k.startswith("model.")}
    assert all(torch.equal(v, gathered[k]) for k, v in single.state_dict().items())  # get_full_state_dict at 2x2
    out = tmp_path / "hf"
    result = run_cli("-q", "convert", url, str(out), "--to", "hf")
    assert result.exit_code == 0, result.stderr
    hf = {}
    for shard in sorted(out.glob("*.safetensors")):
        hf.update(load_file(str(shard)))
    assert sorted(hf) == sorted(single.state_dict())
    assert all(torch.equal(hf[k], v) for k, v in single.state_dict().items())


def test_reshard_of_a_2x2_checkpoint_to_three_ranks_resumes_bitwise(saved_2d, tmp_path):
    url, reference = saved_2d
    out = str(tmp_path / "ws3")
    result = run_cli("-q", "reshard", url, out, "--world-size", "3")
    assert result.exit_code == 0, result.stderr
    resumed = run_layout("fsdp3", resume, out, "shardkit", "fsdp3")
    assert mismatches(reference["saved"], resumed["loaded"]) == []
    assert rel_close(resumed["losses"], reference["losses"][5:])


def test_inspect_shows_the_saved_mesh_and_placements(saved_2d):
    url, _ = saved_2d
    info = json.loads(run_cli("inspect", url, "--json").stdout)
    assert info["layout"]["world_size"] == 4
    assert info["layout"]["mesh"]["shape"] == [2, 2] and info["layout"]["mesh"]["dim_names"] == ["dp", "tp"]
    tensors = {t["name"]: t for t in info["tensors"]}
    assert tensors["model.layers.0.w1.weight"]["placements"] == ["_S(0, 2)", "S(0)"]
    assert tensors["model.layers.0.w2.weight"]["placements"] == ["S(0)", "S(1)"]
    assert tensors["model.layers.0.w2.bias"]["placements"] == ["S(0)", "R"]
    assert tensors["model.emb.weight"]["mesh"] == {"shape": [2], "dim_names": ["dp"]}  # FSDP alone, on dp
    assert tensors["optim.state.layers.0.w1.weight.exp_avg"]["placements"] == ["_S(0, 2)", "S(0)"]
    assert "placements" not in tensors["optim.state.layers.0.w1.weight.step"]  # a plain tensor on every rank
    text = run_cli("inspect", url).stdout
    assert "layout: world size 4, mesh 2x2 (dp, tp)" in text
    assert "  _S(0, 2), S(0) on mesh 2x2 (dp, tp): 15 tensors" in text  # w1 and its bias, output; Adam moments
    assert "  S(0) on mesh 2 (dp): " in text
