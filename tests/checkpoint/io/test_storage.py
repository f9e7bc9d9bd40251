"""Storage backends (local, memory://, S3 on moto), async saves and the checkpoint manager."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import shardkit.checkpoint as skc
from shardkit.checkpoint.training.manager import step_dir
from tests.support.checkpoint_helpers import (
    build_model,
    full_state,
    load_into_fresh,
    make_optimizer,
    mismatches,
    save_trained_two_steps,
    train,
)
from tests.support.dist import run_on_ranks


@pytest.mark.parametrize("compression", [None, "zstd:3"], ids=["raw", "zstd"])
def test_two_rank_save_to_s3_loads_at_three_ranks_bitwise(s3_url, compression):
    root, options = s3_url
    url = f"{root}/run/ckpt"
    saved = run_on_ranks(2, save_trained_two_steps, url, options, compression)[0]
    loaded = run_on_ranks(3, load_into_fresh, url, options)[0]
    assert mismatches(saved, loaded) == []


def test_two_rank_save_to_a_local_path_loads_at_three_ranks_bitwise(tmp_path):
    url = str(tmp_path / "ckpt")
    saved = run_on_ranks(2, save_trained_two_steps, url, None, None)[0]
    assert mismatches(saved, run_on_ranks(3, load_into_fresh, f"file://{url}", None)[0]) == []


def test_memory_filesystem_round_trip_with_manager_and_async_save():
    model = build_model("plain", seed=3)
    opt = make_optimizer(model)
    train(model, opt, range(2))
    manager = skc.CheckpointManager("memory://mgr-roundtrip", keep_last=2, async_save=True)
    for step in (10, 20, 30):
        manager.save(step, model, opt, extra={"step": step})
    manager.wait()
    assert manager.steps() == [20, 30]
    fresh = build_model("plain", seed=4)
    fresh_opt = make_optimizer(fresh)
    assert manager.load_latest(fresh, fresh_opt) == (30, {"step": 30})
    assert mismatches(full_state(model, opt), full_state(fresh, fresh_opt)) == []


def test_manager_ignores_uncommitted_steps_and_returns_none_when_empty(tmp_path):
    manager = skc.CheckpointManager(str(tmp_path / "run"))
    model = build_model("plain", seed=5)
    assert manager.load_latest(model) is None
    manager.save(1, model, extra={"note": "first"})
    partial = tmp_path / "run" / step_dir(2) / "data"
    partial.mkdir(parents=True)
    (partial / "0123456789-0-0.safetensors").write_bytes(b"partial upload")
    assert manager.steps() == [1]
    assert manager.load_latest(build_model("plain", seed=6)) == (1, {"note": "first"})
    manager.save(3, model)  # a newer commit sweeps the older partial step
    other = build_model("plain", seed=6)
    assert manager.load(1, other) == {"note": "first"}
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))
    with pytest.raises(skc_errors().CheckpointNotFound):
        manager.load(2, other)
    assert sorted(os.listdir(tmp_path / "run")) == [step_dir(1), step_dir(3)]


def test_keep_last_deletes_only_after_a_newer_step_committed(tmp_path):
    manager = skc.CheckpointManager(str(tmp_path / "run"), keep_last=1)
    model = build_model("plain", seed=5)
    manager.save(1, model)
    with pytest.raises(skc_errors().ConfigurationError):
        manager.save(2, model, extra={"bad": object()})
    assert manager.steps() == [1]  # the failed save did not cost us step 1
    manager.save(2, model)
    assert manager.steps() == [2]


def skc_errors():
    import shardkit.errors as errors

    return errors


def test_cached_s3_listings_never_hide_new_steps_or_show_deleted_ones(s3_url):
    root, options = s3_url
    cached = {**options, "use_listings_cache": True}
    watcher = skc.CheckpointManager(f"{root}/run", storage_options=cached)
    writer = skc.CheckpointManager(f"{root}/run", storage_options=options, keep_last=1)
    model = build_model("plain", seed=8)
    assert watcher.steps() == []  # primes the listing cache
    writer.save(5, model)
    assert watcher.steps() == [5]
    writer.save(6, model)  # retention deletes step 5
    assert watcher.steps() == [6]
    assert watcher.load_latest(build_model("plain", seed=9))[0] == 6


def test_load_detects_hf_and_torch_save_sources_and_fills_the_model_in_place(tmp_path):
    from safetensors.torch import save_file

    source = build_model("plain", seed=11)
    torch.save(source.state_dict(), tmp_path / "model.pt")
    (tmp_path / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "hf" / "model.safetensors"))
    for url in (str(tmp_path / "model.pt"), str(tmp_path / "hf")):
        model = build_model("plain", seed=12)
        pointers = {k: v.data_ptr() for k, v in model.state_dict().items()}
        sd = skc.get_training_state(model)
        skc.load(sd, url)
        assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())
        assert {k: v.data_ptr() for k, v in model.state_dict().items()} == pointers


def _save_then_fail_on_rank_one(url):
    from shardkit.errors import ShardkitError

    skc.save({"w": torch.ones(64, 64)}, url, chunk_bytes=4096)
    state = {"w": torch.zeros(64, 64), "extra": object() if dist.get_rank() == 1 else 1}
    try:
        skc.save(state, url, chunk_bytes=4096)
    except ShardkitError as exc:
        return type(exc).__name__
    return "saved"


def test_a_save_failing_on_one_rank_raises_everywhere_and_leaves_the_previous_checkpoint(tmp_path):
    url = str(tmp_path / "ckpt")
    assert run_on_ranks(2, _save_then_fail_on_rank_one, url) == ["ConfigurationError", "ConfigurationError"]
    target = {"w": torch.zeros(64, 64)}
    skc.load(target, url)
    assert torch.equal(target["w"], torch.ones(64, 64))
    import json

    listed = json.loads((tmp_path / "ckpt" / "manifest.json").read_bytes())["files"]
    assert sorted(f"data/{n}" for n in os.listdir(tmp_path / "ckpt" / "data")) == sorted(listed)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_storage_probes_its_own_url_and_retries_only_transient_failures(tmp_path, where):
    import fsspec

    from shardkit.checkpoint.io.storage import Storage
    from shardkit.errors import CheckpointNotFound, StorageError

    url = str(tmp_path / "ck") if where == "local" else "memory://probe-dir"
    fs = fsspec.filesystem("file" if where == "local" else "memory")
    fs.makedirs(f"{url}/data", exist_ok=True)
    fs.pipe(f"{url}/data/f.bin", b"x")
    st = Storage(url)
    assert st.exists() and st.is_dir() and st.exists("data/f.bin") and st.is_dir("data")
    assert not st.is_dir("data/f.bin") and not st.is_dir("nope") and not st.exists("nope")
    assert not Storage(f"{url}/missing").exists() and not Storage(f"{url}/missing").is_dir()
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("connection reset")
        return 7

    assert st.retry("probing", flaky) == 7 and len(calls) == 3

    def denied():
        raise PermissionError("403")

    def missing():
        raise FileNotFoundError("x")

    with pytest.raises(StorageError, match="probing: permission denied"):
        st.retry("probing", denied)
    with pytest.raises(CheckpointNotFound, match="probing: not found"):
        st.retry("probing", missing)
    if where == "memory":
        st.delete_tree()
