"""``convert --to hf`` of a training checkpoint gives a folder ``from_pretrained`` loads: config, tokenizer
and generation files from ``--config`` (or those a converted HF source carried), tied weights written as
``save_pretrained`` writes them, ``--dtype`` in the config; and an HF folder loads strictly into a tied model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.errors import ConfigurationError, IncompatibleStateDict
from tests.support.dist import run_on_ranks
from tests.support.offline_cli import run_cli

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

INDEX = "model.safetensors.index.json"
VOCAB = 50


def _config(kind: str):
    if kind == "gpt2":  # GPT-2 ties lm_head.weight to transformer.wte.weight
        return transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32,
                                       bos_token_id=0, eos_token_id=1)
    return transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=VOCAB, bos_token_id=0, eos_token_id=1,
                                    tie_word_embeddings=kind == "llama-tied")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[EOS]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")


def _model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(_config(kind))


def _train_step(model) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    opt.step()
    return opt


def _saved_pretrained(kind: str, path: Path) -> Path:
    """What a user has beside a training run: the folder save_pretrained wrote before training (config,
    generation config, the initial weights) plus the tokenizer."""
    _model(kind, seed=99).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per model kind: (config dir, native training checkpoint, the trained model)."""
    root = tmp_path_factory.mktemp("hf-export")
    out = {}
    for kind in ("gpt2", "llama-tied", "llama-untied"):
        config_dir = _saved_pretrained(kind, root / f"{kind}-config")
        model = _model(kind)
        opt = _train_step(model)
        skc.save(skc.get_training_state(model, opt), str(root / f"{kind}-ckpt"), meta={"step": 1})
        out[kind] = (config_dir, root / f"{kind}-ckpt", model)
    return out


def _assert_loads_the_same(out: Path, model, **kwargs):
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True, **kwargs)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and info["error_msgs"] == [], info
    want, got = model.state_dict(), loaded.state_dict()
    assert set(want) == set(got)
    for name, value in want.items():
        assert torch.equal(value, got[name]), name
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, loaded.eval()(ids).logits)
    return loaded


def _weight_names(out: Path) -> list[str]:
    """The HF keys of an export of a model this small: one shard, so ``model.safetensors`` and no index."""
    from safetensors import safe_open

    assert not (out / INDEX).exists()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


@pytest.mark.parametrize("kind", ["gpt2", "llama-tied"])
def test_hf_export_of_a_tied_training_checkpoint_loads_with_from_pretrained(trained, tmp_path, kind):
    config_dir, ckpt, model = trained[kind]
    out = tmp_path / "hf"
    skc.convert(str(ckpt), str(out), to="hf", config=str(config_dir))
    assert "lm_head.weight" not in _weight_names(out)  # as save_pretrained writes a tied model
    assert _weight_names(out) == sorted(k for k in model.state_dict() if k != "lm_head.weight")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (config_dir / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in config_dir.iterdir())  # the same files
    loaded = _assert_loads_the_same(out, model)
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    text = "w3 w7 w11 w49"
    assert transformers.AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == _tokenizer()(text)["input_ids"]


def test_hf_export_of_an_untied_training_checkpoint_loads_with_from_pretrained(trained, tmp_path):
    config_dir, ckpt, model = trained["llama-untied"]
    skc.convert(str(ckpt), str(tmp_path / "hf"), to="hf", config=str(config_dir / "config.json"))
    assert "lm_head.weight" in _weight_names(tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir() if not p.name.startswith("model")) == ["config.json"]
    loaded = _assert_loads_the_same(tmp_path / "hf", model)
    assert loaded.lm_head.weight is not loaded.get_input_embeddings().weight


def test_hf_export_writes_a_tied_head_in_full_when_the_config_does_not_say_it_ties_word_embeddings(trained,
                                                                                                    tmp_path):
    """An absent tie_word_embeddings is the model class's default (False for Llama): leaving the head out
    would have from_pretrained initialise it at random."""
    config_dir, ckpt, model = trained["llama-tied"]
    config = json.loads((config_dir / "config.json").read_text())
    del config["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    skc.convert(str(ckpt), str(tmp_path / "hf"), to="hf", config=str(tmp_path / "config.json"))
    assert "lm_head.weight" in _weight_names(tmp_path / "hf")
    loaded = _assert_loads_the_same(tmp_path / "hf", model)
    assert loaded.lm_head.weight is not loaded.get_input_embeddings().weight
    assert skc.diff(str(ckpt), str(tmp_path / "hf")).equal


def test_hf_export_with_dtype_bf16_writes_it_into_config_and_from_pretrained_loads_bf16(trained, tmp_path):
    config_dir, ckpt, model = trained["gpt2"]
    out = tmp_path / "hf"
    result = run_cli("convert", str(ckpt), str(out), "--to", "hf", "--config", str(config_dir), "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    assert "lm_head.weight not written: config.json ties word embeddings" in result.stderr
    written = json.loads((out / "config.json").read_text())
    original = json.loads((config_dir / "config.json").read_text())
    assert written.pop("dtype") == "bfloat16" and original.pop("dtype") == "float32"
    assert written == original  # nothing else changes
    assert transformers.AutoConfig.from_pretrained(str(out)).dtype == torch.bfloat16
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight.to(torch.bfloat16))
    # a config that names neither key gets both: torch_dtype (older transformers) and dtype (newer)
    (tmp_path / "plain.json").write_text(json.dumps({k: v for k, v in original.items() if k != "torch_dtype"}))
    skc.convert(str(ckpt), str(tmp_path / "hf2"), to="hf", config=str(tmp_path / "plain.json"), dtype="fp16")
    written = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert written["torch_dtype"] == written["dtype"] == "float16"


def test_hf_export_without_a_config_writes_what_the_checkpoint_holds(trained, tmp_path):
    config_dir, ckpt, model = trained["gpt2"]
    skc.convert(str(ckpt), str(tmp_path / "hf"), to="hf")
    assert _weight_names(tmp_path / "hf") == sorted(model.state_dict())  # the head too, in full
    assert not (tmp_path / "hf" / "config.json").exists()
    transformers.AutoConfig.from_pretrained(str(config_dir)).save_pretrained(tmp_path / "hf")  # added later
    _assert_loads_the_same(tmp_path / "hf", model)  # an extra copy of a tied key loads fine


def test_hf_export_uses_the_side_files_a_converted_hf_source_carried(tmp_path):
    src = _saved_pretrained("gpt2", tmp_path / "hf-src")
    skc.convert(str(src), str(tmp_path / "native"), to="shardkit")
    assert (tmp_path / "native" / "extra" / "config.json").exists()
    skc.convert(str(tmp_path / "native"), str(tmp_path / "hf"), to="hf", dtype="bf16")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and loaded.dtype == torch.bfloat16
    # --config FILE replaces the carried config.json; the carried tokenizer files stay
    other = _config("gpt2")
    other.tie_word_embeddings = False
    other.save_pretrained(tmp_path / "untied")
    skc.convert(str(tmp_path / "native"), str(tmp_path / "hf2"), to="hf",
                config=str(tmp_path / "untied" / "config.json"))
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["tie_word_embeddings"] is False
    assert (tmp_path / "hf2" / "tokenizer.json").exists()


def test_hf_export_config_errors_name_the_path_and_leave_dst_untouched(trained, tmp_path):
    _, ckpt, _ = trained["gpt2"]
    dst = tmp_path / "dst"
    with pytest.raises(ConfigurationError, match=f"--config {tmp_path}/nowhere: no such file or directory"):
        skc.convert(str(ckpt), str(dst), to="hf", config=str(tmp_path / "nowhere"))
    (tmp_path / "tok-only").mkdir()
    _tokenizer().save_pretrained(tmp_path / "tok-only")
    with pytest.raises(ConfigurationError, match="tok-only: the directory holds no config.json"):
        skc.convert(str(ckpt), str(dst), to="hf", config=str(tmp_path / "tok-only"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "gpt2",')
    with pytest.raises(ConfigurationError, match=r"broken/config\.json: not valid JSON"):
        skc.convert(str(ckpt), str(dst), to="hf", config=str(tmp_path / "broken"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigurationError, match=r"list\.json: not a JSON object"):
        skc.convert(str(ckpt), str(dst), to="hf", config=str(tmp_path / "list.json"))
    with pytest.raises(ConfigurationError, match="--config applies to hf output only"):
        skc.convert(str(ckpt), str(dst), to="shardkit", config=str(tmp_path / "list.json"))
    assert not dst.exists()
    result = run_cli("convert", str(ckpt), str(dst), "--to", "hf", "--config", str(tmp_path / "nowhere"))
    assert result.exit_code == 1 and result.stderr.strip().splitlines()[-1].startswith("error: --config ")
    assert not dst.exists()


def test_strict_load_of_an_hf_checkpoint_into_a_tied_model_works(tmp_path):
    _model("gpt2", seed=5).save_pretrained(tmp_path / "gpt2")  # no lm_head.weight in the file
    source = _model("gpt2", seed=5)
    target = _model("gpt2", seed=6)
    skc.load(skc.get_training_state(target), str(tmp_path / "gpt2"))  # strict
    assert target.lm_head.weight is target.transformer.wte.weight
    for name, value in source.state_dict().items():
        assert torch.equal(value, target.state_dict()[name]), name
    # an untied model still needs its head: the missing key is reported
    _model("llama-tied", seed=5).save_pretrained(tmp_path / "llama-tied")
    with pytest.raises(IncompatibleStateDict, match=r"missing keys \['model\.lm_head\.weight'\]"):
        skc.load(skc.get_training_state(_model("llama-untied")), str(tmp_path / "llama-tied"))


def _train_sharded_gpt2(path: str) -> dict[str, torch.Tensor] | None:
    """On each rank: GPT-2 sharded by shardkit's fully_shard (one group: the tied weight lives in it once),
    one AdamW step, a native save; rank 0 returns the full trained weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit import fully_shard

    transformers.logging.set_verbosity_error()
    model = _model("gpt2")
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = _train_step(model)
    skc.save(skc.get_training_state(model, opt), path)
    full = {k: v.full_tensor() for k, v in skc.get_training_state(model)["model"].items()}
    return full if dist.get_rank() == 0 else None


def test_hf_export_of_a_two_rank_fully_shard_checkpoint_loads_with_from_pretrained(trained, tmp_path):
    full = run_on_ranks(2, _train_sharded_gpt2, str(tmp_path / "ckpt"))[0]
    assert json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["aliases"] == {
        "model.lm_head.weight": "model.transformer.wte.weight"}
    skc.convert(str(tmp_path / "ckpt"), str(tmp_path / "hf"), to="hf", config=str(trained["gpt2"][0]))
    reference = _model("gpt2")
    reference.load_state_dict(full)  # what the two ranks trained, gathered
    _assert_loads_the_same(tmp_path / "hf", reference)


HEAD = "model.lm_head.weight"
EMBEDDINGS = {"gpt2": "model.transformer.wte.weight", "llama-tied": "model.model.embed_tokens.weight"}


def _exported(trained, kind: str, out: Path) -> tuple[Path, Path]:
    """(the tied training checkpoint, its HF export without the head, as save_pretrained writes it)."""
    config_dir, ckpt, _ = trained[kind]
    skc.convert(str(ckpt), str(out), to="hf", config=str(config_dir))
    assert "lm_head.weight" not in _weight_names(out)
    return ckpt, out


@pytest.mark.parametrize("kind", sorted(EMBEDDINGS))
def test_diff_of_a_tied_checkpoint_and_its_hf_export_is_equal_both_ways(trained, tmp_path, kind):
    from shardkit.checkpoint.offline.diff import TensorDiff

    ckpt, out = _exported(trained, kind, tmp_path / "hf")
    embed = EMBEDDINGS[kind]
    for a, b, holder, other in ((ckpt, out, "a", "b"), (out, ckpt, "b", "a")):
        report = skc.diff(str(a), str(b))
        assert report.equal and all(t.status == "equal" for t in report.tensors)
        assert next(t for t in report.tensors if t.name == HEAD) == TensorDiff(
            HEAD, "equal", 0.0, 0.0, f"{other} stores it once, as {embed} (tied to it in {holder})")
        result = run_cli("diff", str(a), str(b))
        assert result.exit_code == 0 and result.stdout.splitlines()[-1].startswith("equal: "), result.stdout
    # the head alone is compared against the embedding it is stored as
    alone = skc.diff(str(ckpt), str(out), only=[HEAD])
    assert alone.equal and [(t.name, t.status) for t in alone.tensors] == [(HEAD, "equal")]


def test_diff_of_an_hf_export_whose_tied_weight_differs_is_different_both_ways(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt, out = _exported(trained, "llama-tied", tmp_path / "hf")
    shard = out / "model.safetensors"  # an export this small is one shard
    tensors = load_file(str(shard))
    tensors["model.embed_tokens.weight"][3, 5] += 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    embed = EMBEDDINGS["llama-tied"]
    for a, b in ((ckpt, out), (out, ckpt)):
        report = skc.diff(str(a), str(b))
        assert not report.equal
        assert {t.name: t.status for t in report.tensors if t.status != "equal"} == {embed: "different",
                                                                                       HEAD: "different"}
        result = run_cli("diff", str(a), str(b))
        assert result.exit_code == 1 and result.stdout.splitlines()[-1].startswith("DIFFERENT: ")
    alone = skc.diff(str(ckpt), str(out), only=[HEAD])
    assert [(t.name, t.status) for t in alone.tensors] == [(HEAD, "different")] and alone.tensors[0].max_abs > 0


@pytest.mark.parametrize("tie", [False, None], ids=["config-unties", "field-absent"])
def test_diff_counts_a_head_an_hf_folder_lacks_as_one_sided_unless_its_config_ties_it(trained, tmp_path, tie):
    """Only A records the tie; B's config does not tie word embeddings (an absent field is the model class's
    default, False for Llama), so from_pretrained would leave B's head at random: not equal."""
    ckpt, out = _exported(trained, "llama-tied", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    config.pop("tie_word_embeddings") if tie is None else config.update(tie_word_embeddings=tie)
    (out / "config.json").write_text(json.dumps(config))
    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert info["missing_keys"] == {"lm_head.weight"}
    embed = EMBEDDINGS["llama-tied"]
    for a, b, status, holder, other in ((ckpt, out, "only-a", "a", "b"), (out, ckpt, "only-b", "b", "a")):
        report = skc.diff(str(a), str(b))
        assert not report.equal
        assert [(t.name, t.status, t.detail) for t in report.tensors if t.status != "equal"] == [
            (HEAD, status, f"tied to {embed} in {holder}; {other} does not record the tie")]
        result = run_cli("diff", str(a), str(b))
        assert result.exit_code == 1 and result.stdout.splitlines()[-1].startswith("DIFFERENT: "), result.stdout
