"""An HF export killed at its most dangerous moments leaves one checkpoint that shardkit and transformers
agree on -- the old export until the new one is complete, the new one after -- and a rerun finishes it.

Each run is a real process killed with SIGKILL at the named step (the step is patched to kill its own
process), so nothing of shardkit's failure cleanup runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.checkpoint.formats import open_reader
from shardkit.checkpoint.formats.base import read_box
from shardkit.errors import ConfigurationError
from tests.support.offline_cli import run_cli

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

INDEX = "model.safetensors.index.json"
SEVERAL = "4KB"  # the tiny model below in several shards; the 5GB default holds it in one

# the step a kill lands on; kills its own process with SIGKILL, then runs convert with argv's options
_CHILD = """
import json, os, signal, sys
from shardkit.checkpoint import convert
from shardkit.checkpoint.io.storage import Storage

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

at = sys.argv[1]
if at == "first-removal":  # the first file of the old export removed (the commit of shards replacing one file)
    _delete = Storage.delete
    def delete(self, names):
        names = list(names)
        if {"model.safetensors", "model.safetensors.index.json"} & set(names):
            die()
        return _delete(self, names)
    Storage.delete = delete
elif at == "before-commit":  # side files copied; model.safetensors not yet moved into place, or no index yet
    Storage.replace = die
    _put = Storage.put_atomic
    Storage.put_atomic = lambda self, name, data: die() if name == "model.safetensors.index.json" else \\
        _put(self, name, data)
convert(sys.argv[2], sys.argv[3], to="hf", **json.loads(sys.argv[4]))
"""


def _config() -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=50, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, object]:
    """A config folder and two native checkpoints of the same tiny Llama ("old", "new"), with their weights."""
    root = tmp_path_factory.mktemp("hf-kill")
    _config().save_pretrained(root / "config")
    out: dict[str, object] = {"config": root / "config"}
    for name, seed in (("old", 1), ("new", 2)):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(_config())
        skc.save(skc.get_training_state(model), str(root / name))
        out[name] = (root / name, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def _killed(at: str, src: Path, dst: Path, **options) -> None:
    proc = subprocess.run([sys.executable, "-c", _CHILD, at, str(src), str(dst), json.dumps(options)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def _by_shardkit(out: Path) -> dict[str, torch.Tensor]:
    with open_reader(str(out)) as reader:
        return {k[len("model."):]: read_box(reader, k) for k in reader.tensors()}


def _by_transformers(out: Path) -> dict[str, torch.Tensor]:
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    return loaded.state_dict()


def _clean_export(sources, tmp_path: Path, **options) -> list[str]:
    """The files an uninterrupted export of "new" writes."""
    skc.convert(str(sources["new"][0]), str(tmp_path / "clean"), to="hf", config=str(sources["config"]), **options)
    return sorted(os.listdir(tmp_path / "clean"))


def _which(weights: dict[str, torch.Tensor], sources) -> str:
    for name in ("old", "new"):
        want = sources[name][1]
        if set(weights) == set(want) and all(torch.equal(weights[k], want[k]) for k in want):
            return name
    return "neither"


@pytest.mark.parametrize("old_cap,new_cap,loaded", [(SEVERAL, None, "new"), (None, SEVERAL, "old")],
                         ids=["several-shards-to-one", "one-file-to-several"])
def test_an_overwrite_killed_at_its_first_removal_is_one_checkpoint_to_shardkit_and_transformers(
        sources, tmp_path, old_cap, new_cap, loaded):
    """Several shards to one: the commit is model.safetensors moving into place, which transformers loads
    before any index, so the old index and shards are already nobody's.  One file to several: the commit is
    removing the old model.safetensors, which until then shadows the complete new index."""
    out = tmp_path / "hf"
    config = str(sources["config"])
    cap = {"old": {} if old_cap is None else {"max_shard_size": old_cap},
           "new": {} if new_cap is None else {"max_shard_size": new_cap}}
    skc.convert(str(sources["old"][0]), str(out), to="hf", config=config, **cap["old"])
    _killed("first-removal", sources["new"][0], out, config=config, overwrite=True, **cap["new"])
    assert (out / "model.safetensors").exists() and (out / INDEX).exists()  # both exports' files are there
    assert _which(_by_shardkit(out), sources) == _which(_by_transformers(out), sources) == loaded
    assert skc.verify(str(out)).ok

    skc.convert(str(sources["new"][0]), str(out), to="hf", config=config, overwrite=True, **cap["new"])
    assert _which(_by_shardkit(out), sources) == _which(_by_transformers(out), sources) == "new"
    assert sorted(os.listdir(out)) == _clean_export(sources, tmp_path, **cap["new"])


@pytest.mark.parametrize("cap", [None, SEVERAL], ids=["one-file", "several-shards"])
def test_an_export_killed_after_copying_its_config_reruns_without_overwrite(sources, tmp_path, cap):
    out = tmp_path / "hf"
    options = {} if cap is None else {"max_shard_size": cap}
    _killed("before-commit", sources["new"][0], out, config=str(sources["config"]), **options)
    left = sorted(os.listdir(out))
    clean = _clean_export(sources, tmp_path, **options)
    if cap is None:
        assert left[0].startswith(".model.safetensors.partial-") and left[1:] == ["config.json"]
    else:
        assert left == [n for n in clean if n != INDEX] and len(left) > 3  # config.json and the shards

    result = run_cli("-q", "convert", str(sources["new"][0]), str(out), "--to", "hf", "--config",
                     str(sources["config"]), *([] if cap is None else ["--max-shard-size", cap]))
    assert result.exit_code == 0, result.stderr
    assert _which(_by_shardkit(out), sources) == _which(_by_transformers(out), sources) == "new"
    assert sorted(os.listdir(out)) == clean  # the killed run's temporary file is gone


def test_a_folder_of_someone_elses_config_and_notes_is_still_refused(sources, tmp_path):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "theirs"}')
    (out / "notes.md").write_text("mine")
    with pytest.raises(ConfigurationError, match=r"not empty and not a checkpoint \(it holds config.json, notes.md\)"):
        skc.convert(str(sources["new"][0]), str(out), to="hf")
    assert sorted(os.listdir(out)) == ["config.json", "notes.md"]
    assert (out / "config.json").read_text() == '{"model_type": "theirs"}'
