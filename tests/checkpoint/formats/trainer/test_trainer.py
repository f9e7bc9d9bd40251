"""Checkpoints written by the real Accelerate (FSDP2 sharded and full, FSDP1 sharded, the DDP fallback) and
the real Hugging Face Trainer (FSDP2 sharded, DDP) convert to a Hugging Face folder whose model gives the
trained model's logits bitwise, and to shardkit checkpoints that resume at 1 and 3 ranks with the losses the
framework itself had when it went on training."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from shardkit.checkpoint import convert, diff, verify  # noqa: E402
from shardkit.checkpoint.formats import open_reader  # noqa: E402
from shardkit.checkpoint.formats.base import read_box  # noqa: E402
from shardkit.data.rng import restore_rng_state  # noqa: E402
from shardkit.errors import UnsupportedFormat  # noqa: E402
from tests.support.dist import run_on_ranks  # noqa: E402
from tests.support.framework_helpers import (  # noqa: E402
    ACCELERATE_CASES,
    DS_WORLD,
    FRAMEWORK_MODULE_TIMEOUT,
    PROBE,
    STEPS_SAVED,
    TRAINER_CASES,
    build_model,
    llama_config,
    resume_and_train,
    write_checkpoints,
)

pytestmark = [pytest.mark.slow, FRAMEWORK_MODULE_TIMEOUT]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run of the real Accelerate and Trainer writing every case (about 35 s)."""
    out = tmp_path_factory.mktemp("accelerate")
    write_checkpoints("accelerate_run.py", out)
    config = out / "base-model"
    llama_config().save_pretrained(config)
    return out


def _checkpoint(runs, case: str):
    return runs / case / f"checkpoint-{STEPS_SAVED}" if case in TRAINER_CASES else runs / case


def _model_keys() -> list[str]:
    """What a user of a plain accelerate loop passes with --model-keys: named_parameters() order."""
    return [f"model.{n}" for n, _ in build_model().named_parameters()]


@pytest.mark.parametrize("case", [*ACCELERATE_CASES, *TRAINER_CASES])
def test_convert_to_hf_gives_the_trained_models_logits_bitwise(runs, case, tmp_path):
    out = tmp_path / "hf"
    ckpt = _checkpoint(runs, case)
    with open_reader(str(ckpt)) as reader:
        assert reader.info.format == "trainer" and reader.info.world_size == DS_WORLD
    has_config = (ckpt / "config.json").exists()  # the Trainer's DDP checkpoint carries its own
    convert(str(ckpt), str(out), to="hf", config=None if has_config else str(runs / "base-model"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out))
    expected = safetensors_torch.load_file(str(runs / f"{case}.logits.safetensors"))["logits"]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=PROBE).logits, expected)


@pytest.mark.parametrize("case", sorted(TRAINER_CASES))
def test_a_trainer_checkpoint_holds_the_trained_weights_and_its_step(runs, case):
    trained = safetensors_torch.load_file(str(runs / f"{case}.model.safetensors"))
    with open_reader(str(_checkpoint(runs, case))) as reader:
        assert reader.info.meta["step"] == STEPS_SAVED
        for name, tensor in trained.items():
            assert torch.equal(read_box(reader, f"model.{name}"), tensor), name
        groups = reader.values()["optim.param_groups"]
        named = [n for g in groups for n in g["params"]]
        assert sorted(named) == sorted(trained) and reader.values()["lr_scheduler.last_epoch"] == STEPS_SAVED
        if case == "trainer-ddp":  # numbered by torch, named from config.json with the Trainer's decay groups
            assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
            assert "model.norm.weight" in groups[1]["params"]


def test_fsdp2_full_and_fsdp1_sharded_checkpoints_hold_the_fsdp2_sharded_state_bitwise(runs):
    """The same training in three FSDP set-ups: model, optimizer and RNG read back bit for bit alike, so the
    resumes below speak for all three."""
    for case in ("fsdp2-full", "fsdp1-sharded"):
        report = diff(str(runs / "fsdp2-sharded"), str(runs / case))
        assert report.equal and len(report.tensors) == 88 and not report.values, (case, report)


@pytest.mark.parametrize("case,world", [("fsdp2-sharded", 3), ("ddp", 1)])
def test_converted_to_shardkit_resumes_at_another_world_size_with_accelerates_losses(runs, case, world, tmp_path):
    out = tmp_path / "sk"
    keys = _model_keys() if case == "ddp" else None  # a plain loop's numbered optimizer state needs its names
    convert(str(_checkpoint(runs, case)), str(out), to="shardkit", model_keys=keys)
    assert verify(str(out)).ok
    expected = json.loads((runs / f"{case}.losses.json").read_text())["after_save"]
    for losses in run_on_ranks(world, resume_and_train, str(out)):
        assert losses == pytest.approx(expected, rel=1e-6, abs=0)


def test_numbered_optimizer_state_without_names_is_refused_when_written_and_kept_for_inspection(runs, tmp_path):
    with pytest.raises(UnsupportedFormat, match="--model-keys"):
        convert(str(runs / "ddp"), str(tmp_path / "out"), to="shardkit")
    assert not (tmp_path / "out").exists()
    with open_reader(str(runs / "ddp")) as reader:
        assert "optim.state.0.exp_avg" in reader.tensors() and "keyed by parameter number" in \
            reader.skipped_side_files[0]
    convert(str(runs / "ddp"), str(tmp_path / "model-only"), to="shardkit", model_only=True)


def _rng_states(reader) -> list[dict]:
    """shardkit's per-rank RNG states (as ``shardkit.data.rng`` restores them) from a reader's rng.* keys."""
    values, states = reader.values(), []
    for rank in range(values["rng.world_size"]):
        p = f"rng.rank{rank}."
        states.append({"torch": read_box(reader, p + "torch"),
                       "python": {k: values[f"{p}python.{k}"] for k in ("version", "state", "gauss")},
                       "numpy": {"key": read_box(reader, p + "numpy.key"),
                                 **{k: values[f"{p}numpy.{k}"]
                                    for k in ("kind", "pos", "has_gauss", "cached_gaussian")}}})
    return states


@pytest.mark.parametrize("case,pattern,keys", [("fsdp2-sharded", "random_states_{}.pkl", ("torch_manual_seed",
                                                                                       "random_state")),
                                                ("trainer-ddp", "rng_state_{}.pth", ("cpu", "python"))])
def test_every_ranks_rng_file_becomes_shardkit_rng_state_that_restores_it_exactly(runs, case, pattern, keys):
    ckpt = _checkpoint(runs, case)
    with open_reader(str(ckpt)) as reader:
        states = _rng_states(reader)
    assert len(states) == DS_WORLD
    saved = torch.get_rng_state(), random.getstate()
    try:
        for rank in range(DS_WORLD):
            raw = torch.load(ckpt / pattern.format(rank), weights_only=False)  # our own test run's file: trusted
            restore_rng_state(states, rank, DS_WORLD)
            assert torch.equal(torch.get_rng_state(), raw[keys[0]]) and random.getstate() == raw[keys[1]]
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])


def test_verify_checks_every_part_and_names_the_damaged_one(runs, tmp_path):
    good = verify(str(runs / "fsdp2-sharded"))
    assert good.ok and good.scope == "checksums" and good.bytes_checked > 0
    bad = tmp_path / "fsdp2-sharded"
    shutil.copytree(runs / "fsdp2-sharded", bad)
    victim = bad / "optimizer_0" / "__1_0.distcp"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    report = verify(str(bad))
    assert not report.ok and "optimizer_0/__1_0.distcp" in report.problems[0]
