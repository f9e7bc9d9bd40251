"""A torch.save file of ``DTensor``s (what a sharded job's per-rank ``torch.save`` leaves: torch_checkpointing's
``model_0.pt``) opened with ``--trust-pickle``: a tensor the file holds whole is read; one rank's shard is refused
in one line naming the file and what to open instead -- never an internal error."""

from __future__ import annotations

import pytest
import torch

from shardkit.checkpoint.formats import open_reader
from shardkit.checkpoint.formats.base import read_box
from shardkit.errors import UnsupportedFormat
from tests.support.offline_cli import run_cli


def _save_dtensors(path: str, world_size: int) -> torch.Tensor:
    """``torch.save`` of rank 0's DTensor shard of a (4, 2) weight on a ``world_size`` mesh (a fake process
    group stands in for the job that held it); returns the whole weight."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    weight = torch.arange(8.0).reshape(4, 2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        rows = 4 // world_size
        shard = DTensor.from_local(weight[:rows].clone(), mesh, [Shard(0)], run_check=False)
        torch.save({"model": {"w": shard}}, path)
    finally:
        dist.destroy_process_group()
    return weight


@pytest.fixture
def shard_file(tmp_path):
    path = str(tmp_path / "model_0.pt")
    _save_dtensors(path, world_size=2)
    return path


@pytest.fixture
def whole_file(tmp_path):
    path = str(tmp_path / "model_0.pt")
    return path, _save_dtensors(path, world_size=1)


def test_dtensors_need_no_trust_pickle_they_are_on_torchs_allowlist(shard_file):
    with pytest.raises(UnsupportedFormat, match="one rank's share of a sharded checkpoint"):
        open_reader(shard_file)


def test_a_trusted_file_of_one_ranks_shards_is_refused_naming_the_file_and_the_shard(shard_file):
    with pytest.raises(UnsupportedFormat, match=r"model_0\.pt: model\.w: a DTensor holding one rank's part "
                                                r"\(\(2, 2\) of \(4, 2\)"):
        open_reader(shard_file, trust_pickle=True)


def test_a_trusted_dtensor_held_whole_is_read_bitwise(whole_file):
    path, weight = whole_file
    with open_reader(path, trust_pickle=True) as reader:
        assert reader.tensors()["model.w"].shape == (4, 2)
        assert torch.equal(read_box(reader, "model.w"), weight)


@pytest.mark.parametrize("command", [["inspect"], ["convert", "--to", "shardkit"]], ids=["inspect", "convert"])
def test_every_trust_pickle_command_on_a_shard_file_ends_in_one_line_and_exit_1(tmp_path, shard_file, command):
    args = [command[0], shard_file] + ([str(tmp_path / "out")] if command[0] == "convert" else []) + command[1:]
    result = run_cli(*args, "--trust-pickle")
    assert result.exit_code == 1, result.stderr
    assert "internal error" not in result.stderr
    assert "one rank's share of a sharded checkpoint" in result.stderr
    assert not (tmp_path / "out").exists()
