"""DeepSpeed ZeRO checkpoints written by the real DeepSpeed (stages 1, 2, 3, on CPU with gloo) are read
bitwise as DeepSpeed itself reconstructs them, converted to every format, resumed by shardkit at other world
sizes, and refused when their pickles name a class outside the allowlist."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from shardkit.checkpoint import convert, diff, inspect, reshard, verify  # noqa: E402
from shardkit.checkpoint.formats import open_reader  # noqa: E402
from shardkit.checkpoint.formats.base import read_box  # noqa: E402
from shardkit.errors import InvalidManifest, UnsafeCheckpoint, UnsupportedFormat  # noqa: E402
from tests.support.dist import run_on_ranks  # noqa: E402
from tests.support.framework_helpers import (  # noqa: E402
    CASES,
    FRAMEWORK_MODULE_TIMEOUT,
    STATE_KEYS,
    STEPS_SAVED,
    build_model,
    global_batch,
    llama_config,
    resume_and_train,
    write_checkpoints,
)
from tests.support.offline_helpers import peak_rss  # noqa: E402

MiB = 1 << 20

pytestmark = [pytest.mark.slow, FRAMEWORK_MODULE_TIMEOUT]


BIG_ROWS = 16384  # the big case: embedding and lm_head of 16384 x 1024 fp32, 128 MiB of weights


@pytest.fixture(scope="module")
def zero(tmp_path_factory):
    """One run of the real DeepSpeed writing every case (about 25 s)."""
    out = tmp_path_factory.mktemp("deepspeed")
    write_checkpoints("deepspeed_run.py", out, "--big-embedding", str(BIG_ROWS))
    return out


def _reference(zero, case: str, which: str) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(str(zero / f"{case}.{which}.safetensors"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_equal_deepspeeds_own_zero_to_fp32_bitwise(zero, case):
    expected = _reference(zero, case, "zero_to_fp32")  # buffers, frozen and tied parameters included
    with open_reader(str(zero / case)) as reader:
        assert reader.info.format == "deepspeed" and reader.info.world_size == 2
        assert reader.info.meta["zero_stage"] == CASES[case][0] and reader.info.meta["step"] == STEPS_SAVED
        model_keys = {k for k in reader.tensors() if k.startswith("model.")}
        assert model_keys == set(expected)
        for key, tensor in expected.items():
            got = read_box(reader, key)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), key


@pytest.mark.parametrize("case", sorted(CASES))
def test_master_weights_and_optimizer_state_equal_the_live_engines_bitwise(zero, case):
    """Adam's moments (Adagrad's sum) per parameter, as DeepSpeed's safe_get_full_optimizer_state gives them."""
    live = _reference(zero, case, "live")
    keys = STATE_KEYS[CASES[case][1]]
    with open_reader(str(zero / case)) as reader:
        state_keys = {k for k in reader.tensors() if k.startswith("optim.state.")}
        assert {k for k in live if k.startswith("optim.state.")} <= state_keys
        assert all(k.rsplit(".", 1)[1] in (*keys, "step") for k in state_keys)
        for key, tensor in live.items():
            assert torch.equal(read_box(reader, key), tensor), key
        step = read_box(reader, "optim.state.model.embed_tokens.weight.step")
        assert step.item() == STEPS_SAVED


def test_param_groups_name_the_trainable_parameters_and_keep_the_hyperparameters(zero):
    with open_reader(str(zero / "stage3-tied-frozen")) as reader:
        (group,) = reader.values()["optim.param_groups"]
    model = build_model(tied=True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]  # FQNs, as torch's optimizers key them
    assert group["params"] == trainable and "model.norm.weight" not in group["params"]
    assert group["lr"] == 1e-2 and group["weight_decay"] == 0.01 and group["betas"] == [0.9, 0.999]
    with open_reader(str(zero / "stage3-groups")) as reader:  # 2 groups, split into sub-groups of 3000 elements
        assert reader.info.meta["zero_stage"] == 3
        decay, no_decay = reader.values()["optim.param_groups"]
    names = [n for n, _ in build_model().named_parameters()]
    assert decay["params"] == [n for n in names if "norm" not in n] and decay["weight_decay"] == 0.01
    assert no_decay["params"] == [n for n in names if "norm" in n] and no_decay["weight_decay"] == 0.0


def test_convert_to_every_format_and_reshard_round_trip_bitwise(zero, tmp_path):
    src = str(zero / "stage3")
    for to in ("shardkit", "torch", "dcp"):
        out = tmp_path / to
        convert(src, str(out), to=to)
        report = diff(src, str(out))
        assert report.equal, (to, report)
    out = tmp_path / "resharded"
    reshard(src, str(out), world_size=3)
    assert diff(src, str(out)).equal and verify(str(out)).ok


def test_convert_to_hf_gives_a_model_from_pretrained_loads_with_deepspeeds_weights(zero, tmp_path):
    ckpt = tmp_path / "checkpoint-2"   # as a Trainer run lays it out: config.json beside latest and global_step2/
    shutil.copytree(zero / "stage3-tied-frozen", ckpt)
    llama_config(tied=True).save_pretrained(ckpt)
    convert(str(ckpt), str(tmp_path / "hf"), to="hf")
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    expected = build_model(tied=True)
    expected.load_state_dict({k[len("model."):]: v for k, v in _reference(zero, "stage3-tied-frozen",
                                                                        "zero_to_fp32").items()})
    ids = global_batch(STEPS_SAVED + 1)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected(ids).logits)


def test_diff_of_a_tied_zero2_checkpoint_and_its_hf_export_is_equal_both_ways(zero, tmp_path):
    from tests.support.offline_cli import run_cli

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(zero / "stage2-tied-frozen", ckpt)
    llama_config(tied=True).save_pretrained(ckpt)
    convert(str(ckpt), str(tmp_path / "hf"), to="hf")  # leaves the tied head out, as save_pretrained does
    with open_reader(str(tmp_path / "hf")) as reader:
        assert "model.lm_head.weight" not in reader.tensors()
    for a, b, holder, other in ((ckpt, tmp_path / "hf", "a", "b"), (tmp_path / "hf", ckpt, "b", "a")):
        report = diff(str(a), str(b))
        assert report.equal and all(t.status == "equal" for t in report.tensors)
        head = next(t for t in report.tensors if t.name == "model.lm_head.weight")
        assert head.detail == f"{other} stores it once, as model.model.embed_tokens.weight (tied to it in {holder})"
        assert run_cli("diff", str(a), str(b)).exit_code == 0


@pytest.mark.parametrize("case,world", [("stage2-tied-frozen", 3)])
def test_load_resumes_a_deepspeed_run_at_another_world_size_with_its_losses(zero, case, world):
    expected = json.loads((zero / f"{case}.losses.json").read_text())["after_save"]
    for losses in run_on_ranks(world, resume_and_train, str(zero / case), CASES[case][2]):
        assert losses == pytest.approx(expected, rel=1e-6, abs=0)


def test_a_client_state_naming_a_class_outside_the_allowlist_is_refused_naming_it(zero, tmp_path):
    with pytest.raises(UnsafeCheckpoint, match=r"argparse\.Namespace"):
        open_reader(str(zero / "unsafe"))
    report = verify(str(zero / "unsafe"))
    assert not report.ok and "argparse.Namespace" in report.problems[0]
    with pytest.raises(UnsafeCheckpoint, match=r"argparse\.Namespace"):
        convert(str(zero / "unsafe"), str(tmp_path / "out"), to="shardkit")
    assert not (tmp_path / "out").exists()


def test_verify_checks_every_record_and_names_a_damaged_partition(zero, tmp_path):
    good = verify(str(zero / "stage2-adagrad"))
    assert good.ok and good.scope == "checksums" and good.bytes_checked > 0
    bad = tmp_path / "stage2"
    shutil.copytree(zero / "stage2-adagrad", bad)
    victim = bad / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    report = verify(str(bad))
    assert not report.ok and "zero_pp_rank_1_mp_rank_00_optim_states" in report.problems[0]


def test_a_missing_rank_file_or_a_latest_naming_nothing_is_refused(zero, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(zero / "stage2-adagrad", partial)
    (partial / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(InvalidManifest, match="2 ranks.*1 optimizer-state file"):
        open_reader(str(partial))
    dangling = tmp_path / "dangling"
    shutil.copytree(zero / "stage2-adagrad", dangling)
    (dangling / "latest").write_text("global_step9")
    with pytest.raises(InvalidManifest, match="global_step9"):
        open_reader(str(dangling), format="deepspeed")


def test_inspect_names_the_stage_and_deepspeed_is_read_only(zero, tmp_path):
    info = inspect(str(zero / "stage1-odd"))
    assert info["format"] == "deepspeed" and info["meta"]["zero_stage"] == 1
    with pytest.raises(UnsupportedFormat, match="does not write"):
        convert(str(zero / "stage1-odd"), str(tmp_path / "out"), to="deepspeed")


def test_convert_of_a_checkpoint_8x_the_budget_stays_within_budget_plus_256mib(zero, tmp_path):
    """128 MiB of weights and 256 MiB of Adam moments in flat partitions, converted whole at --max-memory
    16MiB in a fresh process: peak RSS (interpreter and torch included) <= 16 MiB + 256 MiB."""
    src, out = str(zero / "big"), str(tmp_path / "out")
    code, peak = peak_rss([sys.executable, "-m", "shardkit", "-q", "convert", src, out, "--to", "shardkit",
                           "--max-memory", "16MiB"])
    assert code == 0
    assert peak <= 16 * MiB + 256 * MiB, f"peak RSS {peak / MiB:.0f} MiB"
    with open_reader(src) as reader:
        assert sum(e.nbytes for e in reader.tensors().values()) >= 3 * 128 * MiB
    rows = ((BIG_ROWS - 100, 0), (100, 1024))
    with open_reader(src) as a, open_reader(out) as b:
        for key in ("model.lm_head.weight", "optim.state.lm_head.weight.exp_avg_sq"):
            assert torch.equal(read_box(a, key, rows), read_box(b, key, rows)), key


def test_a_latest_naming_a_folder_without_model_states_is_refused_naming_it(tmp_path):
    (tmp_path / "run" / "global_step1").mkdir(parents=True)
    (tmp_path / "run" / "latest").write_text("global_step1")
    (tmp_path / "run" / "global_step1" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(InvalidManifest, match="no \\*_model_states.pt"):
        open_reader(str(tmp_path / "run"), format="deepspeed")


def test_a_trainer_checkpoint_with_deepspeed_is_read_as_deepspeed_with_its_config(zero, tmp_path):
    """A Trainer run with DeepSpeed keeps latest and global_stepN/ in checkpoint-N/, beside model.safetensors,
    rng_state_<r>.pth and trainer_state.json: the ZeRO state is what is read, and only the model's own files
    travel to --to hf."""
    import random

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(zero / "stage3", ckpt)
    safetensors_torch.save_file({"lm_head.weight": torch.zeros(2, 2)}, str(ckpt / "model.safetensors"))
    torch.save({"python": random.getstate(), "cpu": torch.get_rng_state()}, ckpt / "rng_state_0.pth")
    (ckpt / "trainer_state.json").write_text('{"global_step": 2}')
    llama_config().save_pretrained(ckpt)
    with open_reader(str(ckpt)) as reader:
        assert reader.info.format == "deepspeed" and reader.side_files == ["config.json"]
        assert "optim.state.lm_head.weight.exp_avg" in reader.tensors()
