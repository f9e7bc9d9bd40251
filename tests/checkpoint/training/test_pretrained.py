"""Pretrained Hugging Face weights into a model built on the meta device and fully sharded.

The recipe of docs/pretrained.md, on a tiny ``LlamaForCausalLM`` that
``save_pretrained`` wrote (no downloads): meta init, ``fully_shard`` on every
layer and the root, ``to_empty``, ``skc.load_pretrained``.  Its logits equal
``from_pretrained``'s bitwise (the same weights, the same ``inv_freq``, the
same kernels on the same inputs); each rank reads exactly its shards' bytes
from the weight files, plus headers; the hub cache's snapshot layout
resolves as ``from_pretrained`` resolves it offline.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import shardkit.checkpoint as skc
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.training.pretrained import non_persistent_buffers, resolve_pretrained
from shardkit.errors import CheckpointNotFound, ConfigurationError
from tests.support.dist import run_on_ranks

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROBE = torch.arange(0, 4096, 86)[:48].reshape(3, 16)


def _config(tied: bool = False):
    # a vocabulary large enough that the weights (1.1 MB) dwarf the 64 KiB header read of each file
    return transformers.LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def _save(folder: Path, tied: bool = False, **kwargs) -> Path:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_config(tied)).save_pretrained(folder, **kwargs)
    return folder


def _hub_cache(root: Path, weights: Path) -> Path:
    """What ``hf download tiny/llama`` leaves: blobs, a snapshot of links to them, refs/main naming it."""
    repo = root / "models--tiny--llama"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(weights.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    return repo


def _sharded_llama(config) -> nn.Module:
    from shardkit import fully_shard

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    return model


def _load_counting_reads(path: str, folder: str, **kwargs) -> dict:
    """On every rank: the recipe, counting the bytes this rank reads from storage (data into its shards,
    and everything else: headers, index, config)."""
    read = {"data": 0, "other": 0}
    originals = Storage.read_parts, Storage.read_bytes

    def read_parts(self, name, start, parts):
        read["data"] += sum(p.numel() for p in parts)
        return originals[0](self, name, start, parts)

    def read_bytes(self, name, start=None, end=None):
        out = originals[1](self, name, start, end)
        read["other"] += len(out)
        return out

    model = _sharded_llama(transformers.AutoConfig.from_pretrained(folder))
    Storage.read_parts, Storage.read_bytes = read_parts, read_bytes
    try:
        resolved = skc.load_pretrained(model, path, **kwargs)
    finally:
        Storage.read_parts, Storage.read_bytes = originals
    share = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    return dict(logits=logits, resolved=resolved, share=share, **read)


def _reference_logits(folder: Path) -> torch.Tensor:
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        return reference(input_ids=PROBE).logits


def _weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


@pytest.mark.parametrize("shards", ["one-file", "index"])
def test_recipe_logits_equal_from_pretrained_and_each_rank_reads_its_half(tmp_path, shards):
    kwargs = {"max_shard_size": "600KB"} if shards == "index" else {}
    folder = _save(tmp_path / "hf", **kwargs)
    assert (folder / "model.safetensors.index.json").exists() == (shards == "index")
    files = len(list(folder.glob("*.safetensors")))
    ranks = run_on_ranks(2, _load_counting_reads, str(folder), str(folder))
    expected = _reference_logits(folder)
    for r in ranks:
        assert torch.equal(r["logits"], expected)
    total = _weight_bytes(folder)
    # data: exactly the rank's own shards (every tensor is cut by rows, read by ranged reads)
    assert [r["data"] for r in ranks] == [r["share"] for r in ranks]
    assert sum(r["share"] for r in ranks) <= total
    for r in ranks:
        # headers (at most 64 KiB read per file), the index, config.json: small beside the half
        assert r["other"] <= files * (64 << 10) + (16 << 10), r["other"]
        assert r["data"] + r["other"] <= total / 2 + files * (64 << 10) + (16 << 10)
    print(f"\n{shards}: {total} bytes of weights in {files} file(s); per rank read "
          f"{[(r['data'], r['other']) for r in ranks]} (data, other); shares {[r['share'] for r in ranks]}")


def test_hub_cache_snapshot_resolves_by_repo_id_folder_and_commit(tmp_path):
    weights = _save(tmp_path / "hf")
    repo = _hub_cache(tmp_path / "hub", weights)
    snapshot = str(repo / "snapshots" / COMMIT)
    assert resolve_pretrained(str(repo)) == snapshot
    assert resolve_pretrained("tiny/llama", cache_dir=str(tmp_path / "hub")) == snapshot
    assert resolve_pretrained(str(repo), revision=COMMIT) == snapshot
    assert resolve_pretrained(snapshot) == snapshot
    ranks = run_on_ranks(2, _load_counting_reads, "tiny/llama", str(weights), cache_dir=str(tmp_path / "hub"))
    expected = _reference_logits(weights)
    assert [r["resolved"] for r in ranks] == [snapshot] * 2
    assert all(torch.equal(r["logits"], expected) for r in ranks)
    assert [r["data"] for r in ranks] == [r["share"] for r in ranks]


def test_hub_cache_names_what_is_missing(tmp_path):
    repo = _hub_cache(tmp_path / "hub", _save(tmp_path / "hf"))
    with pytest.raises(CheckpointNotFound, match=r"not in the Hugging Face cache .*hf download other/model"):
        resolve_pretrained("other/model", cache_dir=str(tmp_path / "hub"))
    with pytest.raises(CheckpointNotFound, match=rf"revision 'v2' .*snapshots: {COMMIT}"):
        resolve_pretrained(str(repo), revision="v2")
    (repo / "refs" / "main").write_text("f" * 40)
    with pytest.raises(CheckpointNotFound, match=r"refs/main names commit 'f{40}'"):
        resolve_pretrained(str(repo))


def test_tied_llama_loads_without_lm_head_in_the_files(tmp_path):
    folder = _save(tmp_path / "hf", tied=True)
    ranks = run_on_ranks(2, _load_counting_reads, str(folder), str(folder))
    assert all(torch.equal(r["logits"], _reference_logits(folder)) for r in ranks)


def _inv_freq_after_to_empty(folder: str) -> tuple[list[str], bool, bool]:
    config = transformers.AutoConfig.from_pretrained(folder)
    model = _sharded_llama(config)
    rotary = model.model.rotary_emb
    rotary.inv_freq.fill_(float("nan"))  # what to_empty may leave
    rotary.original_inv_freq.fill_(float("nan"))
    skc.load_pretrained(model, folder)
    expected = type(rotary)(config).inv_freq
    return non_persistent_buffers(model), torch.equal(rotary.inv_freq, expected), \
        torch.equal(rotary.original_inv_freq, expected)


def test_non_persistent_buffers_are_recomputed(tmp_path):
    folder = _save(tmp_path / "hf")
    names, inv_freq, original = run_on_ranks(2, _inv_freq_after_to_empty, str(folder))[0]
    assert names == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert inv_freq and original


class _WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(4, 4).tril(), persistent=False)


def test_a_buffer_shardkit_cannot_compute_is_refused_before_reading(tmp_path):
    with pytest.raises(ConfigurationError, match=r"non-persistent buffer\(s\) mask: .*init_buffers="):
        skc.load_pretrained(_WithMask(), str(tmp_path))  # the folder is empty: refused before any read
    model = _WithMask()
    model.mask.zero_()
    folder = tmp_path / "w"
    folder.mkdir()
    from safetensors.torch import save_file

    save_file({"w.weight": torch.eye(4), "w.bias": torch.zeros(4)}, str(folder / "model.safetensors"))
    skc.load_pretrained(model, str(folder), init_buffers=lambda m: m.mask.copy_(torch.ones(4, 4).tril()))
    assert torch.equal(model.w.weight, torch.eye(4)) and torch.equal(model.mask, torch.ones(4, 4).tril())


def test_key_map_loads_a_causal_lm_checkpoint_into_its_base_model(tmp_path):
    folder = _save(tmp_path / "hf")
    base = transformers.LlamaModel(_config())
    skc.load_pretrained(base, str(folder), key_map=lambda k: "model." + k, strict=False)
    full = transformers.LlamaForCausalLM.from_pretrained(folder)
    assert all(torch.equal(v, full.model.state_dict()[k]) for k, v in base.state_dict().items())
