"""Tied weights in native checkpoints: stored once, recorded as an alias, loaded into both keys, kept by the
offline tools, and validated like every other part of the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.checkpoint.formats.base import read_box
from shardkit.checkpoint.formats.native.reader import NativeReader
from shardkit.errors import CheckpointError, IncompatibleStateDict, InvalidManifest
from tests.support.dist import run_on_ranks
from tests.support.models import ModelArgs, Transformer, lm_loss, make_batch

TIED = ModelArgs(tie_embeddings=True)
HEAD, EMBED = "model.output.weight", "model.tok_embeddings.weight"


def _trained(args: ModelArgs = TIED, seed: int = 0) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Transformer(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = make_batch(args, 2, seed=seed)
    lm_loss(model(tokens), targets).backward()
    opt.step()
    return model, opt


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _stored_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / "data").iterdir())


@pytest.fixture(scope="module")
def tied_ckpt(tmp_path_factory) -> tuple[Path, Transformer]:
    model, opt = _trained()
    path = tmp_path_factory.mktemp("tied") / "ckpt"
    skc.save(skc.get_training_state(model, opt), str(path), meta={"step": 1})
    return path, model


def test_a_tied_weight_is_stored_once_and_recorded_as_an_alias_with_one_optimizer_state(tied_ckpt, tmp_path):
    path, model = tied_ckpt
    doc = _manifest(path)
    assert doc["aliases"] == {HEAD: EMBED}
    assert HEAD not in doc["tensors"] and EMBED in doc["tensors"]
    # the optimizer holds one state per parameter object: the tied weight has one, under its first name
    optim_keys = [k for k in doc["tensors"] if k.startswith("optim.state.")]
    assert any(k.startswith("optim.state.tok_embeddings.weight.") for k in optim_keys)
    assert not any(k.startswith("optim.state.output.weight.") for k in optim_keys)
    groups = doc["values"]["optim.param_groups"]
    assert "tok_embeddings.weight" in groups[0]["params"] and "output.weight" not in groups[0]["params"]
    skc.async_save(skc.get_training_state(model), str(tmp_path / "async")).result()  # staged: still once
    assert _manifest(tmp_path / "async")["aliases"] == {HEAD: EMBED}
    # the same state saved with the two keys untied (separate copies) stores the embedding twice
    untied = skc.get_training_state(model)
    untied["model"]["output.weight"] = untied["model"]["output.weight"].clone()
    skc.save(untied, str(tmp_path / "copies"))
    assert "aliases" not in _manifest(tmp_path / "copies")  # no field at all when nothing is tied
    embedding = model.tok_embeddings.weight.numel() * 4
    model_only = tmp_path / "model-only"
    skc.save(skc.get_training_state(model), str(model_only))
    assert _stored_bytes(tmp_path / "copies") - _stored_bytes(model_only) >= embedding


def test_strict_load_of_a_tied_checkpoint_fills_tied_and_untied_models_bitwise(tied_ckpt, tmp_path):
    path, model = tied_ckpt
    fresh, fresh_opt = _trained(seed=3)
    target = skc.get_training_state(fresh, fresh_opt)
    assert skc.load(target, str(path)) == {"step": 1}
    skc.set_training_state(fresh, fresh_opt, target)
    assert fresh.output.weight is fresh.tok_embeddings.weight  # still tied
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    skc.save(skc.get_training_state(model), str(tmp_path / "weights"))
    untied, _ = _trained(ModelArgs(tie_embeddings=False), seed=4)
    skc.load(skc.get_training_state(untied), str(tmp_path / "weights"))  # strict: the alias fills the untied head
    assert torch.equal(untied.output.weight, model.tok_embeddings.weight)
    assert torch.equal(untied.tok_embeddings.weight, model.tok_embeddings.weight)


def test_a_checkpoint_without_aliases_loads_strictly_into_a_tied_model(tied_ckpt, tmp_path):
    """A manifest from before the field (a tied model saved as two copies) still loads."""
    _, model = tied_ckpt
    state = {"model": {k: v.clone() for k, v in skc.get_training_state(model)["model"].items()}}
    skc.save(state, str(tmp_path / "old"))
    assert "aliases" not in _manifest(tmp_path / "old") and HEAD in _manifest(tmp_path / "old")["tensors"]
    fresh, _ = _trained(seed=5)
    skc.load(skc.get_training_state(fresh), str(tmp_path / "old"))
    assert torch.equal(fresh.output.weight, model.output.weight) and fresh.output.weight is fresh.tok_embeddings.weight


def test_a_tied_target_still_reports_its_key_missing_when_no_key_of_the_tie_is_stored(tied_ckpt, tmp_path):
    path, _ = tied_ckpt
    skc.convert(str(path), str(tmp_path / "no-embed"), to="shardkit", exclude=[EMBED, HEAD, "optim.*"])
    fresh, _ = _trained(seed=6)
    with pytest.raises(IncompatibleStateDict, match="missing keys.*tok_embeddings"):
        skc.load(skc.get_training_state(fresh), str(tmp_path / "no-embed"))


@pytest.mark.parametrize("aliases,match", [
    ({HEAD: "model.nothing"}, "'model.nothing', which is no stored tensor"),
    ({HEAD: EMBED, "model.again": HEAD}, "points at 'model.output.weight', which is another alias"),
    ({HEAD: "model.again", "model.again": HEAD}, "which is another alias"),
    ({"model.norm.weight": EMBED}, "'model.norm.weight' is also a stored tensor"),
    ({"optim.param_groups": EMBED}, "is also a stored value"),
    ({HEAD: ["not", "a", "key"]}, "which is no stored tensor"),
    ({"": EMBED}, "a key must be a string of 1 to 4096 characters"),
    ([HEAD, EMBED], "aliases must be a JSON object"),
])
def test_bad_aliases_in_a_manifest_are_refused_naming_the_key(tied_ckpt, tmp_path, aliases, match):
    path, _ = tied_ckpt
    copy = tmp_path / "ckpt"
    copy.mkdir()
    (copy / "data").symlink_to(path / "data")
    doc = _manifest(path)
    doc["aliases"] = aliases
    (copy / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(InvalidManifest, match=match):
        NativeReader(str(copy))


def test_reshard_and_convert_to_shardkit_keep_aliases_and_renames_follow_them(tied_ckpt, tmp_path):
    path, model = tied_ckpt
    skc.reshard(str(path), str(tmp_path / "ws3"), world_size=3)
    assert _manifest(tmp_path / "ws3")["aliases"] == {HEAD: EMBED}
    skc.convert(str(path), str(tmp_path / "renamed"), to="shardkit", rename=[r"^model\.=model.lm."])
    assert _manifest(tmp_path / "renamed")["aliases"] == {"model.lm.output.weight": "model.lm.tok_embeddings.weight"}
    # an alias whose key is filtered out, or cast to another dtype, becomes a tensor of its own
    skc.convert(str(path), str(tmp_path / "no-embed"), to="shardkit", exclude=[EMBED])
    doc = _manifest(tmp_path / "no-embed")
    assert "aliases" not in doc and HEAD in doc["tensors"]
    reader = NativeReader(str(tmp_path / "no-embed"))
    assert torch.equal(read_box(reader, HEAD), model.tok_embeddings.weight.detach())
    skc.convert(str(path), str(tmp_path / "bf16"), to="shardkit", dtype="bf16")
    assert _manifest(tmp_path / "bf16")["aliases"] == {HEAD: EMBED}
    assert skc.diff(str(path), str(tmp_path / "ws3")).equal


def test_inspect_counts_a_tied_weight_once_and_diff_and_verify_treat_the_alias_as_its_key(tied_ckpt, tmp_path):
    path, model = tied_ckpt
    info = skc.inspect(str(path))
    rows = {t["name"]: t for t in info["tensors"]}
    assert rows[HEAD]["alias_of"] == EMBED and rows[HEAD]["chunks"] == 0
    assert info["totals"]["aliases"] == 1
    assert info["totals"]["bytes"] == sum(t["bytes"] for t in info["tensors"]) - rows[HEAD]["bytes"]
    assert skc.verify(str(path)).ok
    same = skc.diff(str(path), str(path))
    assert same.equal and next(t for t in same.tensors if t.name == HEAD).detail == f"tied to {EMBED} on both sides"
    # torch.save output has no aliases: the head is written in full, and equals the checkpoint's alias
    skc.convert(str(path), str(tmp_path / "model.pt"), to="torch")
    across = skc.diff(str(path), str(tmp_path / "model.pt"))
    assert across.equal and next(t for t in across.tensors if t.name == HEAD).status == "equal"
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(loaded["model"]["output.weight"], model.tok_embeddings.weight.detach())


def _save_sharded_tied(path: str, disagree: bool) -> dict[str, torch.Tensor] | str | None:
    """On each rank: the tied Transformer sharded by shardkit, one step, then a save; returns rank 0's
    full model state.  With ``disagree`` rank 1 unties its state dict, and each rank returns its error."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit import fully_shard

    torch.manual_seed(0)
    model = Transformer(TIED)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root's group holds the tied weight once
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = make_batch(TIED, 2, seed=1)
    lm_loss(model(tokens), targets).backward()
    opt.step()
    state = skc.get_training_state(model, opt)
    if disagree:
        if dist.get_rank() == 1:
            state["model"]["output.weight"] = state["model"]["output.weight"].clone()  # same values, own memory
        try:
            skc.save(state, path)
        except CheckpointError as exc:
            return str(exc)
        return None
    skc.save(state, path)
    full = {k: v.full_tensor() for k, v in skc.get_training_state(model)["model"].items()}
    return full if dist.get_rank() == 0 else None


def test_a_two_rank_sharded_tied_model_saves_the_weight_once_and_loads_in_one_process(tmp_path):
    full = run_on_ranks(2, _save_sharded_tied, str(tmp_path / "ckpt"), False)[0]
    assert _manifest(tmp_path / "ckpt")["aliases"] == {HEAD: EMBED}
    fresh, fresh_opt = _trained(seed=7)
    target = skc.get_training_state(fresh, fresh_opt)
    skc.load(target, str(tmp_path / "ckpt"))
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, full[name]), name
    errors = run_on_ranks(2, _save_sharded_tied, str(tmp_path / "split"), True)
    assert all(e and "ranks disagree about tied tensors" in e for e in errors), errors
    assert not (tmp_path / "split" / "manifest.json").exists()


def test_diff_counts_a_tied_key_filtered_out_of_one_side_as_held_by_the_other_only(tied_ckpt, tmp_path):
    """Only the side holding the head records its tie; the side it was filtered out of says nothing of
    it (a load of that side into an untied model misses it), so the head is on one side only."""
    from tests.support.offline_cli import run_cli

    path, model = tied_ckpt
    no_head = tmp_path / "no-head"
    skc.convert(str(path), str(no_head), to="shardkit", exclude=[HEAD])
    assert HEAD not in NativeReader(str(no_head)).tensors() and "aliases" not in _manifest(no_head)
    for a, b, status, detail in ((path, no_head, "only-a", f"tied to {EMBED} in a; b does not record the tie"),
                                 (no_head, path, "only-b", f"tied to {EMBED} in b; a does not record the tie")):
        report = skc.diff(str(a), str(b))
        assert not report.equal
        assert [(t.name, t.status, t.detail) for t in report.tensors if t.status != "equal"] == [(HEAD, status,
                                                                                                  detail)]
        assert run_cli("diff", str(a), str(b)).exit_code == 1
    # untied, the head merely equals the embedding: no side records a tie, so the head is on one side only
    state = skc.get_training_state(model)
    state["model"]["output.weight"] = state["model"]["output.weight"].clone()
    untied = tmp_path / "untied"
    skc.save(state, str(untied))
    assert "aliases" not in _manifest(untied)
    for a, b, status in ((untied, no_head, "only-a"), (no_head, untied, "only-b")):
        report = skc.diff(str(a), str(b), only=["model.*"])
        assert not report.equal
        assert [(t.name, t.status) for t in report.tensors if t.status != "equal"] == [(HEAD, status)]
        assert run_cli("diff", str(a), str(b), "--only", "model.*").exit_code == 1
