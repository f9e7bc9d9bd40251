"""Real producers and consumers on both ends of the offline tools.

* a native checkpoint saved by shardkit's own ``save`` from a 2-rank ``fully_shard`` job reshards
  offline to 3 and 1 ranks bitwise, and the 3-rank output loads into a 3-rank job;
* a DCP checkpoint written by ``dcp.save`` from torch's ``fully_shard`` converts to native and loads
  with ``shardkit.checkpoint.load``;
* a ``transformers`` model saved with ``save_pretrained`` in several shards goes
  hf → native → reshard → hf and ``from_pretrained`` gives identical logits.
(torch's ``dcp.load`` reading our DCP output is in test_formats_dcp.py.)
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from shardkit.checkpoint import convert, diff, reshard, verify
from shardkit.checkpoint.formats import open_reader
from shardkit.checkpoint.formats.base import read_box
from tests.support.dist import run_on_ranks
from tests.support.formats_helpers import torch_fully_shard_dcp
from tests.support.models import ModelArgs, Transformer, sharded_transformer
from tests.support.offline_cli import run_cli
from tests.support.offline_helpers import EXTRA_VALUES, shardkit_two_rank_save


def _read_all(url: str) -> dict[str, torch.Tensor]:
    with open_reader(url) as reader:
        return {k: read_box(reader, k) for k in reader.tensors()}


def _load_at_three_ranks(path: str):
    import torch.distributed as dist

    import shardkit.checkpoint as skc
    from shardkit import fully_shard

    model, optim, _ = sharded_transformer(fully_shard, seed=1)
    sd = skc.get_training_state(model, optim)
    sd["extra"] = {k: 0.0 for k in EXTRA_VALUES}
    skc.load(sd, path)
    skc.set_training_state(model, optim, sd)
    full = skc.get_full_state_dict(model)
    return ({k: v.clone() for k, v in full["model"].items()}, sd["extra"]) if dist.get_rank() == 0 else None


def test_two_rank_shardkit_save_reshards_offline_to_3_and_1_and_loads_at_3(tmp_path):
    saved, _ = shardkit_two_rank_save()
    original = _read_all(saved)
    assert any(k.startswith("optim.state.") for k in original)
    for world in (3, 1):
        out = str(tmp_path / f"ws{world}")
        reshard(saved, out, world_size=world, max_memory="16MiB")
        got = _read_all(out)
        assert sorted(got) == sorted(original)
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in original.items())
        assert diff(saved, out).equal
    loaded, extra = run_on_ranks(3, _load_at_three_ranks, str(tmp_path / "ws3"))[0]
    for key, tensor in loaded.items():
        assert torch.equal(tensor, original[f"model.{key}"]), key
    assert extra["best_loss"] == math.inf and extra["worst_loss"] == -math.inf
    assert math.isnan(extra["last_bad_loss"]) and extra["epoch"] == 2


def test_dcp_from_torch_fully_shard_converts_to_native_and_loads(tmp_path):
    import shardkit.checkpoint as skc

    src, flat, _ = torch_fully_shard_dcp()
    out = str(tmp_path / "native")
    result = run_cli("-q", "convert", src, out, "--to", "shardkit")
    assert result.exit_code == 0, result.stderr
    assert verify(out).ok
    model = Transformer(ModelArgs())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sd = skc.get_training_state(model, optim)
    skc.load(sd, out)
    skc.set_training_state(model, optim, sd)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, flat[f"model.{name}"]), name
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optim.state.items():
        for key, value in state.items():
            assert torch.equal(value, flat[f"optim.state.{names[id(param)]}.{key}"]), (names[id(param)], key)
    assert diff(src, out).equal


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    root = tmp_path_factory.mktemp("llama")
    model.save_pretrained(root / "hf", max_shard_size="40KB")
    return model, root


def test_transformers_model_goes_hf_native_reshard_hf_and_loads_with_identical_logits(tiny_llama):
    from transformers import LlamaForCausalLM

    model, root = tiny_llama
    hf = root / "hf"
    assert len(json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]) > 10
    assert len(list(hf.glob("*.safetensors"))) > 3
    assert run_cli("-q", "convert", str(hf), str(root / "native"), "--to", "shardkit").exit_code == 0
    assert run_cli("-q", "reshard", str(root / "native"), str(root / "ws3"), "--world-size", "3").exit_code == 0
    assert run_cli("-q", "convert", str(root / "ws3"), str(root / "out"), "--to", "hf",
                   "--max-shard-size", "60KB").exit_code == 0
    out = root / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(p.numel() * p.element_size() for p in model.state_dict().values())
    assert len(set(index["weight_map"].values())) > 1 and (out / "config.json").exists()
    from safetensors import safe_open

    for shard in set(index["weight_map"].values()):
        with safe_open(str(out / shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
    reloaded = LlamaForCausalLM.from_pretrained(str(out)).eval()
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)


def test_hf_shards_are_greedy_in_key_order_under_the_cap(tiny_llama, tmp_path):
    _, root = tiny_llama
    out = tmp_path / "capped"
    convert(str(root / "hf"), str(out), to="hf", max_shard_size="50KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    sizes = [os.path.getsize(out / f) for f in files]
    with open_reader(str(root / "hf")) as reader:
        order = list(reader.tensors())  # HF key order of the source
    placed = [int(index["weight_map"][k[len("model."):]].split("-")[1]) for k in order]
    assert placed == sorted(placed)  # greedy in key order: shard numbers never go back
    payload = [s - 8 - int.from_bytes((out / f).read_bytes()[:8], "little") for f, s in zip(files, sizes)]
    assert all(p <= 50_000 for p in payload)
    with open_reader(str(root / "hf")) as reader:
        nbytes = {k[len("model."):]: e.nbytes for k, e in reader.tensors().items()}
    keys = [k[len("model."):] for k in order]
    for shard in range(1, len(files)):  # greedy: each full shard could not take the next tensor
        first_of_next = next(k for k in keys if index["weight_map"][k] == files[shard])
        assert payload[shard - 1] + nbytes[first_of_next] > 50_000, files[shard - 1]
