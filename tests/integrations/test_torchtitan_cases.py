"""ShardkitCheckpointManager against the cases torchtitan's own checkpoint tests pin for its managers.

torchtitan's tests/unit_tests/test_checkpoint.py and test_torch_checkpointing.py
check the seam's contract on one process: config validation, interval and
forced last saves, the first-step save, ``load_only``, a disabled manager, what
a step holds (no non-persistent buffers, a model-only last step), fresh starts,
``load_step`` errors, ``initial_load_path`` precedence, retention and its purge
thread, remote folders.  These tests hold this manager to the same contract,
one process, no process group; the multi-rank behaviour is in test_torchtitan.py.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from dataclasses import dataclass, field, fields

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan.components.checkpointer")

from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager  # noqa: E402
from torchtitan.config import Configurable  # noqa: E402
from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402

from shardkit.checkpoint.formats import open_reader  # noqa: E402
from shardkit.errors import CheckpointNotFound, ConfigurationError, IncompatibleStateDict  # noqa: E402
from shardkit.integrations.torchtitan import ShardkitCheckpointManager  # noqa: E402
from shardkit.integrations.torchtitan.override import TARGET  # noqa: E402
from shardkit.integrations.torchtitan.steps import committed_steps, latest_step  # noqa: E402
from tests.support.torchtitan_ranks import shardkit_config  # noqa: E402
from tests.support.torchtitan_seam import Run  # noqa: E402

Config = ShardkitCheckpointManager.Config


def _run(tmp_path, **options) -> Run:
    return Run(shardkit_config(**options), str(tmp_path))


def _stored_keys(url: str) -> set[str]:
    reader = open_reader(url)
    try:
        return {*reader.tensors(), *reader.values()}
    finally:
        reader.close()


# -- configuration ------------------------------------------------------------------------------------------

def test_config_rejects_what_torchtitans_managers_reject():
    with pytest.raises(ValueError, match="folder.*cannot be empty"):
        Config(folder="  ")
    with pytest.raises(ValueError, match="at least 1"):
        Config(interval=0)
    with pytest.raises(ValueError, match="cannot be negative"):
        Config(keep_latest_k=-1)
    with pytest.raises(ValueError, match="at least 2 checkpoint replicas"):
        Config(keep_latest_k=1)
    with pytest.raises(ValueError, match="model key shouldn't be in exclude_from_loading"):
        Config(exclude_from_loading=["model"])
    with pytest.raises(ValueError, match="absolute path or a remote"):
        Config(initial_load_path="relative/step-1")
    with pytest.raises(ValueError, match="requires last_save_model_only"):
        Config(last_save_in_hf=True, last_save_model_only=False)
    with pytest.raises(ValueError, match="requires initial_load_model_only"):
        Config(initial_load_in_hf=True, initial_load_model_only=False)
    with pytest.raises(ConfigurationError, match="Invalid async_mode"):
        Config(async_mode="sometimes")
    assert Config(async_mode="ASYNC").async_mode == "async"
    assert Config(initial_load_path="  gs://bucket/run/step-9  ").initial_load_path == "gs://bucket/run/step-9"


def test_config_keeps_torchtitans_options_and_adds_only_shardkits_own():
    ours = {f.name for f in fields(Config)}
    assert ours - {f.name for f in fields(CheckpointManager.Config)} == {"compression", "storage_options",
                                                                         "verify_first"}
    assert {f.name for f in fields(CheckpointManager.Config)} <= ours
    json.dumps(Config().to_dict())


@dataclass(kw_only=True, slots=True)
class _TrainerLike(Configurable.Config):
    """The node torchtitan's Trainer.Config has: ``checkpoint: BaseCheckpointManager.Config``."""

    checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)


def test_override_imports_swaps_the_dcp_config_for_shardkits_keeping_every_option():
    root = _TrainerLike(checkpoint=CheckpointManager.Config(enable=True, interval=7, keep_latest_k=3,
                                                            async_mode="async", load_step=4))
    apply_overrides(OverrideConfig(imports=[(TARGET, {"compression": "zstd"})]), root)
    assert type(root.checkpoint) is Config
    assert (root.checkpoint.enable, root.checkpoint.interval, root.checkpoint.keep_latest_k,
            root.checkpoint.async_mode, root.checkpoint.load_step) == (True, 7, 3, "async", 4)
    assert root.checkpoint.compression == "zstd"
    assert Config._owner is ShardkitCheckpointManager  # what Trainer's config.checkpoint.build(...) constructs


def test_set_in_a_config_registry_function_its_options_take_torchtitans_command_line_flags():
    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry

    ConfigManager()  # registers torchtitan's tyro rules, as torchtitan.train does
    default = _TrainerLike(checkpoint=Config(enable=True))  # what a config_registry function returns
    parsed = tyro.cli(_TrainerLike, default=default, registry=custom_registry,
                      args=["--checkpoint.interval", "5", "--checkpoint.keep-latest-k", "3",
                            "--checkpoint.async-mode", "async", "--checkpoint.compression", "zstd"])
    assert type(parsed.checkpoint) is Config
    assert (parsed.checkpoint.interval, parsed.checkpoint.keep_latest_k, parsed.checkpoint.async_mode,
            parsed.checkpoint.compression) == (5, 3, "async", "zstd")


def test_a_disabled_manager_does_nothing():
    run = Run(Config(enable=False), "/nonexistent")
    assert isinstance(run.checkpointer, ShardkitCheckpointManager)
    assert run.checkpointer.load() is False
    assert run.checkpointer.save(curr_step=1) is False
    assert run.checkpointer.maybe_wait_for_staging() is None
    assert run.checkpointer.maybe_wait_for_saving() is None
    run.close()


# -- when a step is saved --------------------------------------------------------------------------------

def test_interval_saves_multiples_and_a_last_step_forces_a_save(tmp_path):
    run = _run(tmp_path, interval=3)
    saved = [run.checkpointer.save(s, last_step=last) for s, last in [(1, False), (2, False), (2, True), (3, False),
                                                                       (4, False), (4, True)]]
    run.close()
    assert saved == [False, False, True, True, False, True]
    assert committed_steps(str(tmp_path / "ckpt")) == [2, 3, 4]


def test_enable_first_step_checkpoint_saves_step_1(tmp_path):
    run = _run(tmp_path / "off", interval=10)
    assert [run.checkpointer.save(s) for s in (1, 2, 10)] == [False, False, True]
    run.close()
    run = _run(tmp_path / "on", interval=10, enable_first_step_checkpoint=True)
    assert [run.checkpointer.save(s) for s in (1, 2, 10)] == [True, False, True]
    run.close()


def test_load_only_never_saves(tmp_path):
    run = _run(tmp_path, interval=1, load_only=True)
    assert [run.checkpointer.save(1), run.checkpointer.save(5), run.checkpointer.save(10, last_step=True)] == [
        False, False, False]
    run.close()
    assert not (tmp_path / "ckpt").exists()


# -- what a step holds ----------------------------------------------------------------------------------

class _WithRopeTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 2))
        self.register_buffer("freqs_cis", torch.randn(10, 5), persistent=False)


def test_a_step_holds_every_state_under_shardkits_names_and_no_non_persistent_buffer(tmp_path):
    run = _run(tmp_path)
    extra = _WithRopeTable()
    manager = ShardkitCheckpointManager(
        shardkit_config(), dataloader=run.dataloader, model_parts=[extra], optimizers=run.optimizers,
        lr_schedulers=run.lr_schedulers, states={"train_state": run.train_state, "trainer": torch.tensor([1.25])},
        sd_adapter=None, base_folder=str(tmp_path / "other"))
    manager.save(2)
    manager.close()
    run.close()
    keys = _stored_keys(str(tmp_path / "other" / "ckpt" / "step-2"))
    assert "model.weight" in keys and not any("freqs_cis" in k for k in keys)
    assert {"lr_scheduler.last_epoch", "train_state.step", "train_state.ntokens_seen", "trainer", "dataloader"} <= keys
    assert any(k.startswith("optim.state.") for k in keys)


def test_a_model_only_last_step_holds_no_optimizer_and_a_normal_step_does(tmp_path):
    run = _run(tmp_path, last_save_model_only=True)
    run.train(2, total=2)
    run.close()
    keys = _stored_keys(str(tmp_path / "ckpt" / "step-2"))
    assert keys and all(k.startswith("model.") for k in keys)
    run = _run(tmp_path / "full")
    run.train(2, total=3)
    run.close()
    assert any(k.startswith("optim.") for k in _stored_keys(str(tmp_path / "full" / "ckpt" / "step-2")))


# -- which step is loaded -------------------------------------------------------------------------------

def test_no_folder_is_a_fresh_start(tmp_path, caplog):
    run = _run(tmp_path, folder="nonexistent")
    with caplog.at_level(logging.INFO, logger="shardkit.integrations.torchtitan.manager"):
        assert run.checkpointer.load() is False
    assert "No checkpoint was provided, this is a fresh start." in caplog.text
    run.close()


def test_an_explicit_load_step_without_its_folder_or_step_raises_naming_it(tmp_path):
    run = _run(tmp_path, folder="nonexistent")
    with pytest.raises(FileNotFoundError, match="--checkpoint.load_step=5"):
        run.checkpointer.load(step=5)
    run.close()
    run = _run(tmp_path, interval=1)
    run.train(2)
    os.makedirs(tmp_path / "ckpt" / "step-3" / "data")  # an interrupted save
    for missing in (3, 5):
        with pytest.raises(CheckpointNotFound, match=f"--checkpoint.load_step={missing} not found at .*step-{missing}"):
            run.checkpointer.load(step=missing)
    assert latest_step(str(tmp_path / "ckpt")) == 2
    run.close()


def test_initial_load_path_is_used_only_while_the_folder_holds_no_step(tmp_path):
    donor = _run(tmp_path / "donor")
    donor.train(4)
    donor.close()
    initial = str(tmp_path / "donor" / "ckpt" / "step-2")
    run = _run(tmp_path / "run", initial_load_path=initial, initial_load_model_only=False)
    assert run.checkpointer.load() is True and run.train_state.step == 2  # the folder is empty: initial path
    run.train(4, load=False)
    run.close()
    again = _run(tmp_path / "run", initial_load_path=initial, initial_load_model_only=False)
    assert again.checkpointer.load() is True and again.train_state.step == 4  # its own step wins
    again.close()


def test_an_initial_load_path_without_a_checkpoint_raises_naming_it(tmp_path):
    os.makedirs(tmp_path / "empty")
    run = _run(tmp_path / "run", initial_load_path=str(tmp_path / "empty"))
    with pytest.raises(CheckpointNotFound, match="empty"):
        run.checkpointer.load()
    run.close()


def test_exclude_from_loading_leaves_those_states_as_they_are(tmp_path):
    run = _run(tmp_path, interval=1)
    run.train(3)
    run.close()
    resumed = _run(tmp_path, exclude_from_loading=["lr_scheduler", "train_state"])
    resumed.checkpointer.load()
    assert resumed.train_state.step == 0 and resumed.lr_schedulers.schedulers[0].last_epoch == 0
    resumed.close()
    with pytest.raises(ConfigurationError, match="'nothing'"):
        bad = _run(tmp_path, exclude_from_loading=["nothing"])
        try:
            bad.checkpointer.load()
        finally:
            bad.close()


def test_a_model_only_step_resumes_the_model_alone_whatever_the_job_asks(tmp_path):
    run = _run(tmp_path, last_save_model_only=True)
    run.train(2, total=2)
    run.close()
    fresh = _run(tmp_path / "other", initial_load_path=str(tmp_path / "ckpt" / "step-2"),
                 initial_load_model_only=False)
    assert fresh.checkpointer.load() is True  # the step's meta says model_only: the optimizer is not asked for
    assert fresh.train_state.step == 0
    assert all(torch.equal(a, b) for a, b in zip(fresh.model_parts[0].parameters(), run.model_parts[0].parameters()))
    fresh.close()


# -- retention ------------------------------------------------------------------------------------------

def test_a_failed_delete_does_not_stop_retention_and_is_retried_at_the_next_save(tmp_path, monkeypatch, caplog):
    import shardkit.integrations.torchtitan.manager as manager_module

    real = manager_module.Storage
    failures = []

    class FlakyStorage(real):
        def delete_tree(self, name: str = "") -> None:
            if not failures:
                failures.append(self.url)
                raise OSError("transient backend error")
            super().delete_tree(name)

    monkeypatch.setattr(manager_module, "Storage", FlakyStorage)
    run = _run(tmp_path, interval=1, keep_latest_k=2)
    with caplog.at_level(logging.WARNING):
        run.train(5)
        run.close()
    assert failures == [str(tmp_path / "ckpt" / "step-1")]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-4", "step-5"]  # each purge lists the folder afresh
    assert "transient backend error" in caplog.text


def test_a_remote_folder_saves_resumes_and_never_resumes_a_partial_step(tmp_path):
    import fsspec

    root = f"memory://titan-{os.getpid()}"
    run = Run(shardkit_config(interval=1), root)
    run.train(2)
    run.close()
    with fsspec.open(f"{root}/ckpt/step-3/data/0000000000-0-0.safetensors", "wb") as f:
        f.write(b"\0" * 8)  # a crashed save's data file, no manifest
    assert latest_step(f"{root}/ckpt") == 2
    again = Run(shardkit_config(interval=1), root)
    assert again.checkpointer.load() is True and again.train_state.step == 2
    again.close()
    fsspec.filesystem("memory").rm(f"/titan-{os.getpid()}", recursive=True)


def test_a_wrong_state_is_named(tmp_path):
    run = _run(tmp_path, interval=1)
    run.train(1)
    run.close()
    other = ShardkitCheckpointManager(
        shardkit_config(), dataloader=None, model_parts=[nn.Linear(3, 3)], optimizers=run.optimizers,
        lr_schedulers=run.lr_schedulers, states={}, sd_adapter=None, base_folder=str(tmp_path))
    with pytest.raises(IncompatibleStateDict, match="lacks .* key"):
        other.load()
    other.close()


def test_without_torchtitan_the_import_names_the_extra():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torchtitan'] = None\n"
            "from shardkit.errors import IntegrationUnavailable\n"
            "try:\n    from shardkit.integrations.torchtitan import ShardkitCheckpointManager\n"
            "except IntegrationUnavailable as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'shardkit[torchtitan]'" in done.stdout, done.stderr


def test_an_async_save_waits_for_the_one_before_it(tmp_path):
    run = _run(tmp_path, interval=1, async_mode="async")
    run.checkpointer.save(1)
    first = run.checkpointer.save_future
    assert first is not None and run.checkpointer.staging_future is not None
    run.checkpointer.save(2)
    assert first.done() and run.checkpointer.save_future is not first
    run.checkpointer.maybe_wait_for_staging()
    assert run.checkpointer.staging_future is None
    run.close()
    assert run.checkpointer.save_future is None and committed_steps(str(tmp_path / "ckpt")) == [1, 2]


def test_step_0_is_a_seed_checkpoint_of_the_model_alone(tmp_path):
    seed = _run(tmp_path, last_save_model_only=True)
    seed.checkpointer.save(curr_step=0, last_step=True)  # what torchtitan.train does for create_seed_checkpoint
    seed.close()
    run = Run(shardkit_config(), str(tmp_path), seed=5)
    assert run.checkpointer.load() is True and run.train_state.step == 0
    assert all(torch.equal(a, b) for a, b in zip(run.model_parts[0].parameters(), seed.model_parts[0].parameters()))
    assert not run.optimizers.optimizers[0].state  # nothing but the model was loaded
    run.close()


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_quantized_hf_initial_loads_are_refused_naming_the_manager_that_reads_them(tmp_path):
    config = shardkit_config(initial_load_path="/models/fp4", initial_load_in_hf=True,
                             initial_load_in_hf_quantized=True)
    with pytest.raises(ConfigurationError, match="/models/fp4.*torchtitan's CheckpointManager"):
        Run(config, str(tmp_path))
    gc.collect()  # the half-built manager's __del__ closes it: that must not raise either
