"""A step folder written by the real torch_checkpointing (0.1.1) at 2 gloo ranks -- torch's ``fully_shard``
model and its AdamW state, each item saved with its ``DefaultResharder`` -- is inspected, verified, loaded,
resharded and converted by shardkit bitwise as torch_checkpointing's own load gives it, without running a
pickle; a pickle that names anything outside the allowlist is refused, and an incomplete save is refused.

How torch_checkpointing runs on CPU here (the work-around is in this file only, never in shardkit):

* ``LocalFileSystemStorageConfig(use_direct_io=False)`` and ``CheckpointManager.Config.with_sync_save()``
  (its async saver's staging defaults need CUDA);
* its metadata all-gather, ``DefaultMetadataManager._all_gather_pickled_data``, builds its tensors with
  ``device="cuda"`` unconditionally.  Inside each rank function, :func:`_gloo_metadata_gather` replaces that
  one method, for the duration of the save or load only, by the same exchange done with
  ``torch.distributed.all_gather_object`` on the gloo group (same input: the rank's picklable metadata;
  same output: ``{rank: metadata}``), and puts the original back afterwards.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import zipfile

import pytest
import torch

pytest.importorskip("torch_checkpointing")

import shardkit.checkpoint as skc  # noqa: E402
from shardkit.checkpoint.formats import open_reader  # noqa: E402
from shardkit.checkpoint.formats.base import read_box  # noqa: E402
from shardkit.errors import InvalidManifest, UnsafeCheckpoint, UnsupportedVersion  # noqa: E402
from tests.support.dist import run_on_ranks  # noqa: E402
from tests.support.formats_helpers import flat_full_state  # noqa: E402
from tests.support.offline_cli import run_cli  # noqa: E402

SAVED_STEP = 7


# ---------------------------------------------------------------------------- on the ranks

@contextlib.contextmanager
def _gloo_metadata_gather():
    """torch_checkpointing's metadata all-gather without CUDA (see the module docstring)."""
    import torch.distributed as dist
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    def gather(self, data, process_group=None):
        out = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    original = DefaultMetadataManager._all_gather_pickled_data
    DefaultMetadataManager._all_gather_pickled_data = gather
    try:
        yield
    finally:
        DefaultMetadataManager._all_gather_pickled_data = original


def _model_and_optimizer(seed: int):
    """A tiny MLP under torch's fully_shard (5 and 3 rows: uneven over 2 and 3 ranks) after one AdamW step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))
    model(torch.randn(4, 7)).square().sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _manager():
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    config = CheckpointManager.Config.with_sync_save()
    config.items = {"model": ItemSpec(resharder=DefaultResharder()),
                    "optimizer": ItemSpec(resharder=DefaultResharder())}
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return config.build()


def _save_with_torch_checkpointing(path: str):
    """Save model, optimizer and a train_state the way torchtitan's torch_checkpointing backend does."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _model_and_optimizer(seed=0)
    msd, osd = get_state_dict(model, optim)
    manager = _manager()
    with _gloo_metadata_gather():
        manager.save(path, {"model": msd, "optimizer": osd, "train_state": {"step": SAVED_STEP}})
    manager.close()
    flat, groups = flat_full_state(model, optim)
    return (flat, groups) if dist.get_rank() == 0 else None


def _load_with_torch_checkpointing(path: str):
    """torch_checkpointing's own load into a freshly built model at this world size; the full state after."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _model_and_optimizer(seed=1)
    msd, osd = get_state_dict(model, optim)
    manager = _manager()
    with _gloo_metadata_gather():
        loaded = manager.load(path, into={"model": msd, "optimizer": osd})
    manager.close()
    set_state_dict(model, optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    flat, groups = flat_full_state(model, optim)
    return (flat, groups, loaded.get("train_state")) if dist.get_rank() == 0 else None


def _load_with_shardkit(path: str):
    """``shardkit.checkpoint.load`` of ``path`` into a freshly built model at this world size."""
    import torch.distributed as dist

    model, optim = _model_and_optimizer(seed=1)
    sd = skc.get_training_state(model, optim)
    skc.load(sd, path, strict=False)  # train_state is not this state dict's
    skc.set_training_state(model, optim, sd)
    flat, groups = flat_full_state(model, optim)
    return (flat, groups) if dist.get_rank() == 0 else None


# ---------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """(folder, full state at save time, param_groups) of one real torch_checkpointing save at 2 ranks."""
    path = str(tmp_path_factory.mktemp("torch_checkpointing") / "step-3")
    flat, groups = run_on_ranks(2, _save_with_torch_checkpointing, path)[0]
    return path, flat, groups


@pytest.fixture(scope="module")
def own_load(step):
    """torch_checkpointing's own load of the step at 1, 2 and 3 ranks: world size -> (flat, groups, train)."""
    return {n: run_on_ranks(n, _load_with_torch_checkpointing, step[0])[0] for n in (1, 2, 3)}


def _assert_bitwise(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def _copy(step, tmp_path, name: str = "step-3") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(step[0], dst)
    return dst


# ---------------------------------------------------------------------------- tests

def test_the_folder_holds_what_torch_checkpointing_writes(step):
    assert sorted(os.listdir(step[0])) == ["metadata.pkl", "model_0.pt", "model_1.pt", "optimizer_0.pt",
                                           "optimizer_1.pt", "train_state_0.pt", "train_state_1.pt"]


def test_torch_checkpointings_own_load_gives_back_the_saved_state_at_every_world_size(step, own_load):
    for flat, _, _ in own_load.values():
        _assert_bitwise(flat, step[1])


def test_the_reader_serves_every_tensor_and_value_bitwise(step):
    path, saved, groups = step
    with open_reader(path) as reader:
        assert reader.info.format == "torch_checkpointing" and reader.info.world_size == 2
        _assert_bitwise({k: read_box(reader, k) for k in reader.tensors()}, saved)
        assert reader.values()["train_state.step"] == SAVED_STEP
        assert reader.values()["optim.param_groups"][0]["lr"] == groups[0]["lr"]
        assert reader.values()["optim.param_groups"][0]["params"] == groups[0]["params"]
        assert reader.stats.bytes_read == sum(t.numel() * t.element_size() for t in saved.values())


def test_inspect_and_verify_succeed_on_the_command_line(step):
    inspected = run_cli("inspect", step[0])
    assert inspected.exit_code == 0, inspected.stderr
    assert "torch_checkpointing" in inspected.stdout and "world size 2" in inspected.stdout
    assert "model.0.weight" in inspected.stdout and "optim.state.0.weight.exp_avg" in inspected.stdout
    verified = run_cli("verify", step[0])
    assert verified.exit_code == 0, verified.stderr
    assert verified.stdout.startswith("ok:")


def test_load_from_the_folder_at_the_saved_world_size_equals_torch_checkpointings_own_load(step, own_load):
    flat, groups = run_on_ranks(2, _load_with_shardkit, step[0])[0]
    _assert_bitwise(flat, own_load[2][0])
    assert groups[0]["lr"] == own_load[2][1][0]["lr"]


def test_load_from_the_folder_at_another_world_size_equals_torch_checkpointings_own_load(step, own_load):
    _assert_bitwise(run_on_ranks(3, _load_with_shardkit, step[0])[0][0], own_load[3][0])


@pytest.mark.parametrize("world_size", [1, 3])
def test_reshard_then_load_equals_torch_checkpointings_own_load(step, own_load, tmp_path, world_size):
    out = str(tmp_path / f"native-{world_size}")
    result = run_cli("reshard", step[0], out, "--world-size", str(world_size))
    assert result.exit_code == 0, result.stderr
    assert run_cli("verify", out).exit_code == 0
    _assert_bitwise(run_on_ranks(world_size, _load_with_shardkit, out)[0][0], own_load[world_size][0])


def test_convert_to_native_holds_the_same_tensors_and_values(step, tmp_path):
    out = str(tmp_path / "native")
    result = run_cli("convert", step[0], out, "--to", "shardkit")
    assert result.exit_code == 0, result.stderr
    with open_reader(out) as native:
        _assert_bitwise({k: read_box(native, k) for k in native.tensors()}, step[1])
        assert native.values()["train_state.step"] == SAVED_STEP


def _os_system_pickle(marker) -> bytes:
    """A protocol-2 pickle whose loading would run ``os.system("touch <marker>")``."""
    return b"\x80\x02cos\nsystem\nX" + len(f"touch {marker}").to_bytes(4, "little") + \
        f"touch {marker}".encode() + b"\x85R."


def test_a_metadata_pkl_naming_os_system_is_refused_and_nothing_runs(step, tmp_path):
    folder = _copy(step, tmp_path)
    marker = tmp_path / "ran"
    with open(os.path.join(folder, "metadata.pkl"), "wb") as f:
        f.write(_os_system_pickle(marker))
    with pytest.raises(UnsafeCheckpoint) as refused:
        open_reader(folder)
    assert "metadata.pkl" in str(refused.value) and "system" in str(refused.value)
    result = run_cli("inspect", folder)
    assert result.exit_code != 0 and "metadata.pkl" in result.stderr
    assert not marker.exists()


def test_an_item_file_naming_os_system_is_refused_and_nothing_runs(step, tmp_path):
    folder = _copy(step, tmp_path)
    marker = tmp_path / "ran"
    name = os.path.join(folder, "model_1.pt")
    with zipfile.ZipFile(name) as zf:
        records = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    pickle_name = next(n for n in records if n.endswith("/data.pkl"))
    records[pickle_name] = _os_system_pickle(marker)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for n, data in records.items():
            zf.writestr(n, data)
    with open(name, "wb") as f:
        f.write(buf.getvalue())
    with open_reader(folder) as reader, pytest.raises(UnsafeCheckpoint) as refused:
        read_box(reader, "model.0.weight")
    assert "model_1.pt" in str(refused.value) and "os.system" in str(refused.value)
    result = run_cli("verify", folder)
    assert result.exit_code != 0 and "model_1.pt" in result.stdout + result.stderr
    assert not marker.exists()


def test_metadata_of_another_version_or_shape_is_refused_naming_the_file(step, tmp_path):
    import pickle

    folder = _copy(step, tmp_path)
    with open(os.path.join(folder, "metadata.pkl"), "rb") as f:
        good = pickle.loads(f.read())  # written by the test's own save: trusted
    for bad, error in (({**good, "version": "1.0"}, UnsupportedVersion),
                       ({**good, "world_size": 3}, InvalidManifest),
                       ([good], InvalidManifest)):
        with open(os.path.join(folder, "metadata.pkl"), "wb") as f:
            f.write(pickle.dumps(bad))
        with pytest.raises(error, match="metadata.pkl"):
            open_reader(folder)


def test_a_step_with_a_missing_rank_file_is_refused_naming_it(step, tmp_path):
    folder = _copy(step, tmp_path)
    os.remove(os.path.join(folder, "optimizer_1.pt"))
    with pytest.raises(InvalidManifest, match="optimizer_1.pt"):
        open_reader(folder)
    result = run_cli("verify", folder)
    assert result.exit_code != 0 and "optimizer_1.pt" in result.stdout + result.stderr


def test_the_temporary_folder_of_an_unfinished_save_is_refused(step, tmp_path):
    folder = _copy(step, tmp_path, "tmp_step-3")
    with pytest.raises(InvalidManifest, match="unfinished"):
        open_reader(folder)
    assert run_cli("convert", folder, str(tmp_path / "out"), "--to", "shardkit").exit_code != 0
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_a_flipped_byte_in_a_tensor_record_fails_verify_and_reads(step, tmp_path):
    folder = _copy(step, tmp_path)
    name = os.path.join(folder, "model_0.pt")
    with zipfile.ZipFile(name) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(name, "r+b") as f:
        f.seek(info.header_offset + 26)
        skip = int.from_bytes(f.read(2), "little") + int.from_bytes(f.read(2), "little")
        at = info.header_offset + 30 + skip
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    result = run_cli("verify", folder)
    assert result.exit_code != 0 and "CRC" in result.stdout + result.stderr
    with open_reader(folder) as reader, pytest.raises(Exception, match="CRC"):
        for key in reader.tensors():
            read_box(reader, key)
