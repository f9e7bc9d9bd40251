"""Round trips are bitwise, starting from a checkpoint saved online by a 2-rank shardkit job (several
writers, uneven DTensor shards, inf/nan values): native(2) → reshard 3 → reshard 1 → hf → torch → dcp →
native equals the original for every model tensor; native reshards keep every optimizer tensor;
native → torch → dcp → native keeps everything, non-finite values included; ``shardkit diff`` agrees."""

from __future__ import annotations

import json
import math

import pytest
import torch

from shardkit.checkpoint import convert, diff, inspect, reshard, verify
from shardkit.checkpoint.formats import open_reader
from shardkit.checkpoint.formats.base import read_box
from shardkit.checkpoint.state.tree import from_json_value
from tests.support.offline_cli import run_cli
from tests.support.offline_helpers import EXTRA_VALUES, shardkit_two_rank_save


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Every hop of the chain, built once: (original flat tensors, {hop: path})."""
    saved, flat = shardkit_two_rank_save()
    root = tmp_path_factory.mktemp("chain")
    paths = {"n2": saved, **{k: str(root / k) for k in ("n3", "n1", "hf", "dcp", "native",
                                                          "full_dcp", "full_native")},
             "pt": str(root / "back.pt"), "full_pt": str(root / "full.pt")}
    reshard(paths["n2"], paths["n3"], world_size=3, max_memory="16MiB", workers=2)
    reshard(paths["n3"], paths["n1"], world_size=1, max_memory="16MiB")
    convert(paths["n1"], paths["hf"], to="hf", max_shard_size="20KB")
    convert(paths["hf"], paths["pt"], to="torch")
    convert(paths["pt"], paths["dcp"], to="dcp", max_memory="16MiB")
    convert(paths["dcp"], paths["native"], to="shardkit")
    convert(paths["n1"], paths["full_pt"], to="torch")
    convert(paths["full_pt"], paths["full_dcp"], to="dcp", max_memory="16MiB")
    convert(paths["full_dcp"], paths["full_native"], to="shardkit")
    return flat, paths


def test_the_source_is_an_online_save_by_two_writers_with_uneven_shards(chain):
    _, paths = chain
    manifest = json.loads(open(f"{paths['n2']}/manifest.json").read())
    assert {f["writer"] for f in manifest["files"].values()} == {0, 1}
    vocab = manifest["tensors"]["model.tok_embeddings.weight"]
    assert vocab["shape"][0] % 2 == 1 and len(vocab["chunks"]) >= 2  # 37 rows over 2 ranks: 19 + 18


def _read_all(url: str) -> dict[str, torch.Tensor]:
    with open_reader(url) as reader:
        return {k: read_box(reader, k) for k in reader.tensors()}


def test_every_model_tensor_survives_the_whole_chain_bitwise(chain):
    flat, paths = chain
    final = _read_all(paths["native"])
    model = {k: v for k, v in flat.items() if k.startswith("model.")}
    assert sorted(final) == sorted(model)
    for key, tensor in model.items():
        assert final[key].dtype == tensor.dtype and torch.equal(final[key], tensor), key


@pytest.mark.parametrize("hop", ["n2", "n3", "n1", "full_native"])
def test_native_hops_keep_every_model_and_optimizer_tensor_and_value_bitwise(chain, hop):
    flat, paths = chain
    got = _read_all(paths[hop])
    assert sorted(got) == sorted(flat)
    for key, tensor in flat.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    with open_reader(paths[hop]) as reader:
        values = {k: from_json_value(v) for k, v in reader.values().items()}
    assert values["optim.param_groups"][0]["lr"] == 1e-2
    extra = {k[len("extra."):]: v for k, v in values.items() if k.startswith("extra.")}
    assert extra.keys() == EXTRA_VALUES.keys()
    assert extra["best_loss"] == math.inf and extra["worst_loss"] == -math.inf and math.isnan(extra["last_bad_loss"])
    assert extra["epoch"] == 2


def test_torch_and_dcp_outputs_carry_non_finite_values_as_floats(chain):
    _, paths = chain
    loaded = torch.load(paths["full_pt"], weights_only=True)
    assert loaded["extra"]["best_loss"] == math.inf and math.isnan(loaded["extra"]["last_bad_loss"])
    assert diff(paths["n2"], paths["full_pt"]).equal and diff(paths["full_dcp"], paths["n1"]).equal


@pytest.mark.parametrize("hop,world", [("n2", 2), ("n3", 3), ("n1", 1)])
def test_reshard_writes_each_ranks_shards_into_its_own_file(chain, hop, world):
    _, paths = chain
    manifest = json.loads(open(f"{paths[hop]}/manifest.json").read())
    assert manifest["writer"]["world_size"] == world
    writers = {f["writer"] for f in manifest["files"].values()}
    assert writers == set(range(world))
    for fqn, t in manifest["tensors"].items():
        if not t["shape"]:
            continue
        n, per = t["shape"][0], -(-t["shape"][0] // world)
        for c in t["chunks"]:
            rank = manifest["files"][c["file"]]["writer"]
            lo = c["offsets"][0]
            assert rank * per <= lo and lo + c["shape"][0] <= min(n, (rank + 1) * per), (fqn, c)


def test_cli_diff_reports_zero_difference_along_the_chain(chain):
    _, paths = chain
    for a, b in [("n2", "n3"), ("n3", "n1"), ("n1", "full_native")]:
        result = run_cli("-q", "diff", paths[a], paths[b])
        assert result.exit_code == 0, result.stdout + result.stderr
        assert result.stdout.startswith("equal:") and "max abs diff 0" in result.stdout
        assert "0 values differ" in result.stdout
    result = run_cli("-q", "diff", paths["n2"], paths["native"], "--only", "model.*", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["equal"]
    assert report["tensors"] and all(t["status"] == "equal" and t["max_abs"] == 0.0 for t in report["tensors"])


def test_diff_names_a_changed_tensor_and_a_changed_value_and_exits_one(chain, tmp_path):
    _, paths = chain
    state = torch.load(paths["full_pt"], weights_only=True)
    key = "layers.0.attention.wq.weight"
    state["model"][key][3, 4] += 0.5
    other = tmp_path / "changed.pt"
    torch.save(state, other)
    report = diff(paths["n3"], str(other))
    assert not report.equal and not report.values
    bad = [t for t in report.tensors if t.status != "equal"]
    assert [t.name for t in bad] == [f"model.{key}"] and bad[0].max_abs == pytest.approx(0.5)
    assert diff(paths["n3"], str(other), atol=0.6).equal
    result = run_cli("-q", "diff", paths["n3"], str(other))
    assert result.exit_code == 1 and key in result.stdout and "DIFFERENT" in result.stdout
    state["extra"]["best_loss"] = 1.0
    torch.save(state, other)
    assert diff(paths["n3"], str(other), atol=0.6).values == ["extra.best_loss"]


def test_inspect_and_verify_describe_a_resharded_checkpoint(chain):
    flat, paths = chain
    info = inspect(paths["n3"])
    assert info["format"] == "shardkit" and info["layout"]["world_size"] == 3
    assert info["totals"]["tensors"] == len(flat)
    assert info["totals"]["bytes"] == sum(t.numel() * t.element_size() for t in flat.values())
    report = verify(paths["n3"])
    assert report.ok and report.bytes_checked > 0
    result = run_cli("inspect", paths["n3"])
    assert result.exit_code == 0 and "world size 3, mesh 3 (Shard(dim=0))" in result.stdout
    assert "model.tok_embeddings.weight" in result.stdout


def test_dtype_bf16_casts_weights_but_keeps_optimizer_state(chain, tmp_path):
    flat, paths = chain
    out = str(tmp_path / "bf16")
    reshard(paths["n2"], out, world_size=2, dtype="bf16")
    got = _read_all(out)
    for key, tensor in flat.items():
        if key.startswith("model.") and tensor.is_floating_point():
            assert got[key].dtype == torch.bfloat16 and torch.equal(got[key], tensor.to(torch.bfloat16)), key
        else:
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def test_compressed_reshard_reads_back_bitwise(chain, tmp_path):
    flat, paths = chain
    out = str(tmp_path / "z")
    reshard(paths["n1"], out, mesh="2x2", compression="zstd:3", max_memory="16MiB")
    manifest = json.loads(open(f"{out}/manifest.json").read())
    assert manifest["writer"]["mesh"]["shape"] == [2, 2]
    assert {c["codec"] for t in manifest["tensors"].values() for c in t["chunks"]} == {"zstd"}
    assert {f["writer"] for f in manifest["files"].values()} == {0, 1}  # replicas written once
    got = _read_all(out)
    assert all(torch.equal(got[k], v) for k, v in flat.items())
    assert verify(out).ok


def test_filters_and_renames_apply_before_writing(chain, tmp_path):
    flat, paths = chain
    out = str(tmp_path / "sel")
    convert(paths["n2"], out, to="shardkit", only=["model.layers.*"], exclude=["*.bias"],
            rename=[r"^model\.layers\.=model.blocks."])
    got = _read_all(out)
    want = {k.replace("model.layers.", "model.blocks."): v for k, v in flat.items()
            if k.startswith("model.layers.") and not k.endswith(".bias")}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    model_only = str(tmp_path / "mo")
    convert(paths["n2"], model_only, to="torch", model_only=True)
    loaded = torch.load(model_only, weights_only=True)
    assert set(loaded) == {"model"} and len(loaded["model"]) == sum(k.startswith("model.") for k in flat)
