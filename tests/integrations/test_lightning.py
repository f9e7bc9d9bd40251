"""``ShardkitStrategy`` makes shardkit the checkpoint engine of Lightning's own ``Trainer.fit`` on 2 gloo ranks:
a run stopped after one epoch and resumed with ``fit(ckpt_path="last")`` continues with the uninterrupted run's
losses bitwise, and on one rank with the same samples (losses within 1e-6); its folder passes ``shardkit
verify``.  Lightning's own ``ModelParallelStrategy`` resumes bitwise too (the reference), and its DCP folder
resumes through ``ShardkitStrategy``.  ``ModelCheckpoint``'s top-k removal and ``last``, ``fit(ckpt_path=PATH)``,
``trainer.save_checkpoint`` to a URL with a background save, ``keep_last`` and the ``local=`` hot tier, and the
Fabric round trip each pin what they do.

The fits run under torchrun (``tests/support/lightning_run.py``): one launch on 2 ranks runs every 2-rank case
in the same processes, one launch on 1 rank resumes the 2-rank checkpoint and uses ``memory://``.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from shardkit.errors import (  # noqa: E402
    CheckpointNotFound,
    ConfigurationError,
    DataStateError,
    IncompatibleStateDict,
    UnsafeCheckpoint,
)
from shardkit.integrations.lightning import ShardkitStrategy  # noqa: E402
from shardkit.integrations.lightning.sizes import mesh_sizes  # noqa: E402
from shardkit.integrations.lightning.state import decode_rest, encode_rest  # noqa: E402
from shardkit.integrations.lightning.store import CheckpointStore  # noqa: E402
from tests.support.dist import run_torchrun  # noqa: E402
from tests.support.framework_helpers import FRAMEWORK_MODULE_TIMEOUT, FRAMEWORK_RUN_S  # noqa: E402

SCRIPT = Path(__file__).parents[1] / "support" / "lightning_run.py"
TWO_RANK_CASES = ("resume", "reference", "dcp_into_shardkit", "top_k", "mid_epoch", "link", "path_and_url",
                  "managed", "dedup", "s3", "fabric")
ONE_RANK_CASES = ("resume_other_size", "memory")
EPOCH = 4  # global batches an epoch


def _launch(ranks: int, work: Path, out: Path, cases: tuple[str, ...], env: dict[str, str] | None = None) -> dict:
    done = run_torchrun(SCRIPT, ranks, [str(work), str(out), *cases], timeout=FRAMEWORK_RUN_S, env=env)
    assert done.returncode == 0, f"{SCRIPT.name} {cases} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, s3_server) -> tuple[Path, dict]:
    """Every case's fits: 2 ranks, then 1 rank resuming the 2-rank checkpoint (about 60 s on 2 busy cores).

    The S3 case writes to the local S3 server: through the strategy's ``storage_options``, and through the
    environment for Lightning's own ``ModelCheckpoint`` file operations."""
    import s3fs

    endpoint, options = s3_server
    bucket = f"lightning-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    env = {"S3_URL": f"s3://{bucket}/run", "S3_OPTIONS": json.dumps(options), "AWS_ENDPOINT_URL": endpoint,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    work = tmp_path_factory.mktemp("lightning")
    results = _launch(2, work, work / "two.json", TWO_RANK_CASES, env)
    results.update(_launch(1, work, work / "one.json", ONE_RANK_CASES))
    return work, results


@pytest.mark.slow
@FRAMEWORK_MODULE_TIMEOUT
class TestTrainerFit:
    def test_fit_ckpt_path_last_after_one_epoch_continues_with_the_uninterrupted_losses_bitwise(self, runs):
        _, r = runs
        straight = r["resume"]["straight"]
        assert len(straight) == 2 * EPOCH and r["resume"]["first"] == straight[:EPOCH]
        assert r["resume"]["resumed"] == straight[EPOCH:]  # same global batches, same loss bits
        seen = r["resume"]["seen"]
        assert (seen["global_step"], seen["epoch"]) == (2 * EPOCH, 2)
        assert seen["lr"] == 1e-2 * 0.5 ** 2  # StepLR(3, 0.5) restored at step 4, stepped to 8

    def test_resumed_on_one_rank_the_next_global_batches_are_the_same_and_losses_within_1e_6(self, runs):
        _, r = runs
        straight, other = r["resume"]["straight"][EPOCH:], r["resume_other_size"]["resumed"]
        assert [batch for batch, _ in other] == [batch for batch, _ in straight]
        assert [float.fromhex(loss) for _, loss in other] == pytest.approx(
            [float.fromhex(loss) for _, loss in straight], abs=1e-6, rel=0)

    def test_validate_with_ckpt_path_loads_the_model_alone_into_a_fresh_one(self, runs):
        _, r = runs
        in_memory, from_file = r["resume"]["validate"]
        assert from_file == in_memory  # the trained model's validation loss, bitwise, without its optimizer

    def test_the_saved_folder_passes_shardkit_verify(self, runs):
        work, r = runs
        assert r["resume"]["files"] == ["epoch=1-step=8.ckpt", "last.ckpt"]
        # the epoch-1 last.ckpt as the stopped run left it (the resumed run has since written over the original)
        done = subprocess.run([sys.executable, "-m", "shardkit", "verify", str(work / "shardkit-epoch1")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("ok: shardkit checkpoint"), done.stdout

    def test_lightnings_model_parallel_strategy_resumes_bitwise_on_two_gloo_ranks(self, runs):
        work, r = runs
        ref = r["reference"]
        assert ref["resumed"] == ref["straight"][EPOCH:]
        assert (work / "reference-epoch1" / ".metadata").is_file()  # torch DCP, as Lightning writes it
        assert (work / "reference-epoch1" / "meta.pt").is_file()

    def test_lightnings_dcp_folder_resumes_through_shardkit_strategy_bitwise(self, runs):
        _, r = runs
        resumed = r["dcp_into_shardkit"]["resumed"]
        assert resumed == r["reference"]["straight"][EPOCH:]
        assert resumed == r["resume"]["straight"][EPOCH:]  # torch's and shardkit's fully_shard train alike

    def test_a_mid_epoch_checkpoint_resumes_at_the_next_batch_of_the_epoch_bitwise(self, runs):
        _, r = runs
        straight, case = r["resume"]["straight"], r["mid_epoch"]
        assert case["first"] == straight[:6]  # every_n_train_steps=2, stopped by max_steps=6: epoch 1, batch 2
        assert case["resumed"] == straight[6:]  # the loop's progress and the sampler's position came back
        assert (case["seen"]["global_step"], case["seen"]["epoch"]) == (2 * EPOCH, 2)

    def test_save_top_k_removes_the_worse_checkpoints_and_keeps_last(self, runs):
        work, r = runs
        # the loss falls every epoch: epochs 0 and 1 were saved, then removed through the strategy
        assert r["top_k"]["files"] == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]
        assert r["top_k"]["seen"]["best"].endswith("epoch=3-step=16.ckpt")
        for name in r["top_k"]["files"]:
            assert (work / "top-k" / name / "manifest.json").is_file()

    def test_save_last_link_points_at_the_newest_top_k_folder_and_resumes_through_the_link(self, runs):
        _, r = runs
        case, straight = r["link"], r["top_k"]["records"]  # top_k: the same model trained 4 epochs straight
        assert case["link"] == {"is_link": True, "target": "epoch=1-step=8.ckpt"}
        assert case["resumed"] == straight[2 * EPOCH:3 * EPOCH]
        # epoch 1's folder was removed when epoch 2's became the best; the link moved to it, nothing else went
        assert case["files"] == ["epoch=2-step=12.ckpt", "last.ckpt"] and case["final_target"] == "epoch=2-step=12.ckpt"

    def test_trainer_save_checkpoint_to_a_url_in_the_background_and_fit_from_it_or_a_path(self, runs):
        _, r = runs
        case = r["path_and_url"]
        assert case["url_files"] == ["data", "manifest.json"]
        # both resumes continue the one-epoch run the same way: the uninterrupted second epoch
        assert case["from_url"] == case["from_path"] == r["resume"]["straight"][EPOCH:]
        assert case["first"] == r["resume"]["straight"][:EPOCH]

    def test_memory_url_on_one_rank(self, runs):
        _, r = runs
        case = r["memory"]
        assert case["url_files"] == ["data", "manifest.json"]
        assert case["from_url"] == case["from_path"]
        assert [b for b, _ in case["from_url"]] == [b for b, _ in r["resume"]["straight"][EPOCH:]]

    def test_keep_last_keeps_two_steps_and_the_hot_tier_serves_the_resume(self, runs):
        work, r = runs
        case = r["managed"]
        # 3 epochs saved steps 4, 8, 12 once each (top-k and last point at the same step); keep_last=2
        assert case["files"] == ["epoch=2-step=12.ckpt", "last.ckpt", "step-0000000008", "step-0000000012"]
        pointer = json.loads((work / "managed" / "epoch=3-step=16.ckpt").read_text())
        assert pointer["step"] == 16
        assert sorted({h.split("/")[2] for h in case["hot"]}) == ["step-0000000008", "step-0000000012"]
        assert case["source"] == "local"  # every rank read its own node-local copy
        # the resumed fourth epoch is the uninterrupted 4-epoch run's (top_k case), bitwise
        assert case["resumed"] == r["top_k"]["records"][3 * EPOCH:]

    def test_a_bucket_holds_the_checkpoints_top_k_removes_there_and_fit_resumes_from_an_s3_url(self, runs):
        _, r = runs
        case, straight = r["s3"], r["resume"]["straight"]
        assert case["after_first"] == ["epoch=0-step=4.ckpt", "last.ckpt"]
        assert case["after"] == ["epoch=1-step=8.ckpt", "last.ckpt"]  # epoch 0 removed in the bucket
        assert case["first"] == straight[:EPOCH] and case["resumed"] == straight[EPOCH:]

    def test_dedup_writes_a_frozen_layer_once(self, runs):
        _, r = runs
        case = r["dedup"]
        assert case["files"] == ["epoch=1-step=8.ckpt", "last.ckpt", "step-0000000004", "step-0000000008"]
        first, second = case["bytes"]
        # Linear(8, 32) is frozen: 288 of the 387 weights, with no Adam state; step 8 references them in step 4
        assert second < first / 4, case["bytes"]

    def test_fabric_save_and_load_round_trip_bitwise_on_two_ranks(self, runs):
        _, r = runs
        case = r["fabric"]
        assert case["weights_equal"] and case["moments_equal"]
        assert case["step"] == 2
        assert case["remainder"] == "{'note': {'lr': (0.01, None)}}"  # a tuple and None survive, no pickle


# -- one process, no launch: the refusals a user meets, and the loop state's JSON form ----------------------

def test_the_loop_state_comes_back_exactly_through_json():
    rest = {"epoch": 3, "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4}}}},
            "callbacks": {"ModelCheckpoint{'monitor': 'loss'}": {"kth_value": torch.tensor(float("inf")),
                                                                  "best_k_models": {"a.ckpt": torch.tensor(0.5)}}},
            "lr_schedulers": [{"_last_lr": [0.01], "base_lrs": (0.1,), 3: None}]}
    back = decode_rest(encode_rest(rest, "here"), "here")
    assert back["loops"] == rest["loops"] and back["epoch"] == 3
    assert back["lr_schedulers"] == rest["lr_schedulers"]  # tuple and int key kept
    cb = back["callbacks"]["ModelCheckpoint{'monitor': 'loss'}"]
    assert torch.equal(cb["kth_value"], torch.tensor(float("inf")))
    assert torch.equal(cb["best_k_models"]["a.ckpt"], torch.tensor(0.5))


def test_a_value_json_cannot_hold_is_refused_naming_where_it_sits():
    with pytest.raises(DataStateError, match=r"hyper_parameters\.net"):
        encode_rest({"hyper_parameters": {"net": object()}}, "the Lightning state saved to s3://b/x")


def test_hot_tier_options_without_local_are_refused():
    with pytest.raises(ConfigurationError, match="replicas.*local="):
        ShardkitStrategy(replicas=2)
    with pytest.raises(ConfigurationError, match="unknown checkpoint option"):
        CheckpointStore(keep_lats=2)


def test_auto_sizes_shard_over_every_process_and_a_tensor_size_must_divide_them():
    assert mesh_sizes("auto", 1, 4) == (4, 1) and mesh_sizes("auto", "auto", 2) == (2, 1)
    assert mesh_sizes("auto", 2, 4) == (2, 2) and mesh_sizes(1, 2, 2) == (1, 2)
    with pytest.raises(ConfigurationError, match="tensor_parallel_size=3 does not divide the 4 processes"):
        mesh_sizes("auto", 3, 4)


def test_loading_a_path_that_holds_no_checkpoint_names_it(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFound, match=str(tmp_path / "empty")):
        CheckpointStore().load(str(tmp_path / "empty"), torch.nn.Linear(2, 2), {})


def test_removing_a_folder_neither_engine_wrote_leaves_it_as_it_was(tmp_path, caplog):
    # ModelCheckpoint's top-k names a path to remove; a folder there that is not a checkpoint is someone else's
    foreign = tmp_path / "epoch=0-step=4.ckpt"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with caplog.at_level("WARNING"):
        CheckpointStore().remove(str(foreign))
    assert (foreign / "notes.txt").read_text() == "mine"
    assert "not removing" in caplog.text and str(foreign) in caplog.text


def test_a_torch_save_ckpt_file_is_refused_not_unpickled(tmp_path):
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(IncompatibleStateDict, match="model.ckpt.*not a checkpoint pointer"):
        CheckpointStore().load(str(path), torch.nn.Linear(2, 2), {})


def test_a_lightning_meta_pt_that_needs_pickle_is_refused_naming_the_file(tmp_path):
    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    buf = io.BytesIO()
    torch.save({"hyper_parameters": Path("x")}, buf)  # a class only pickle can rebuild
    (folder / "meta.pt").write_bytes(buf.getvalue())
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.integrations.lightning.store import lightning_meta

    with pytest.raises(UnsafeCheckpoint, match="meta.pt"):
        lightning_meta(Storage(str(folder)), str(folder))


def test_without_lightning_the_import_names_the_extra_to_install(monkeypatch):
    import importlib

    from shardkit.errors import IntegrationUnavailable

    ours = ("lightning.", "shardkit.integrations.lightning")
    for name in [m for m in sys.modules if m == "lightning" or m.startswith(ours)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning", None)  # what an environment without it gives
    with pytest.raises(IntegrationUnavailable, match=r"pip install 'shardkit\[lightning\]'"):
        importlib.import_module("shardkit.integrations.lightning")
