"""A full disk during a save, an async save, a hot-tier copy and ``shardkit reshard``: one clear
``CheckpointOSError`` with errno ENOSPC on every rank, nothing committed, earlier steps intact and loadable
bitwise, no file of the failed save left behind.

The disk is a 1 MiB tmpfs mounted by the test (as root); where the machine refuses the mount those variants
are skipped, and the fsync variant, which needs no mount, still runs: some filesystems (NFS, XFS with
delayed allocation) report ENOSPC only when the data is flushed."""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.errors import CheckpointError, CheckpointOSError
from tests.support.dist import run_on_ranks
from tests.support.offline_cli import run_cli

FULL = "no space left on device (ENOSPC)"


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs at ``tmp_path/disk``, unmounted afterwards; the test is skipped where mounting is refused."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=20)


def _state(seed: int, numel: int) -> dict[str, torch.Tensor]:
    """Incompressible tensors (random bits), ``numel`` float32, the same on every rank (written once)."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(numel, generator=g), "b": torch.arange(8.0)}


def _files_under(path: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files)


def _assert_enospc(exc: BaseException, *needles: str) -> None:
    assert isinstance(exc, CheckpointOSError) and isinstance(exc, OSError) and isinstance(exc, CheckpointError)
    assert exc.errno == errno.ENOSPC, (exc.errno, str(exc))
    for needle in (FULL, *needles):
        assert needle in str(exc), str(exc)


def _save_until_full(disk: str, asynchronous: str | None) -> tuple[str, str, int | None, list[str], float]:
    """Step 1 fits, step 2 does not; what each rank raised, what is left of step 2, and the seconds to raise."""
    import torch.distributed as dist

    skc.save(_state(1, 1000), os.path.join(disk, "step-1"))
    started = time.monotonic()
    try:
        if asynchronous:
            skc.async_save(_state(2, 300_000), os.path.join(disk, "step-2"), writer=asynchronous).result()
        else:
            skc.save(_state(2, 300_000), os.path.join(disk, "step-2"))
    except Exception as exc:  # noqa: BLE001 - what the test inspects
        caught, seconds = exc, time.monotonic() - started
    else:
        raise AssertionError("a save larger than the disk did not fail")
    dist.barrier()
    loaded = {k: torch.empty_like(v) for k, v in _state(1, 1000).items()}
    skc.load(loaded, os.path.join(disk, "step-1"))
    assert all(torch.equal(loaded[k], v) for k, v in _state(1, 1000).items())  # bitwise
    left = _files_under(os.path.join(disk, "step-2"))
    return type(caught).__name__, str(caught), getattr(caught, "errno", None), left, seconds


@pytest.mark.parametrize("asynchronous", [None, "thread", "process"],
                         ids=["save", "async_save", "async_save-writer-process"])
def test_a_save_that_fills_the_disk_fails_on_every_rank_with_enospc_and_leaves_nothing(small_disk, asynchronous):
    per_rank = run_on_ranks(2, _save_until_full, str(small_disk), asynchronous)
    for rank, (kind, message, code, left, seconds) in enumerate(per_rank):
        assert (kind, code) == ("CheckpointOSError", errno.ENOSPC), (rank, kind, message)
        assert FULL in message and f"on the filesystem of {small_disk}/step-2" in message, message
        assert "Free space there (or raise the quota), or save to another location" in message
        assert left == [], left  # no data file, no partial file, no manifest
        assert seconds < 10, seconds  # a full disk is not retried: it fails at once
    assert any("failed on rank" in message and "nothing was committed" in message for _, message, *_ in per_rank)
    assert skc.verify(str(small_disk / "step-1")).ok


def test_an_enospc_at_fsync_removes_the_file_and_names_the_disk(tmp_path, monkeypatch):
    skc.save(_state(0, 100), str(tmp_path / "step-1"))
    real_fsync = os.fsync

    def full_at_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_at_fsync)
    with pytest.raises(CheckpointOSError) as raised:
        skc.save(_state(0, 100), str(tmp_path / "step-2"))
    monkeypatch.setattr(os, "fsync", real_fsync)
    _assert_enospc(raised.value, f"on the filesystem of {tmp_path / 'step-2'}", "the partial file was removed")
    assert _files_under(str(tmp_path / "step-2")) == []
    assert skc.verify(str(tmp_path / "step-1")).ok


def test_a_hot_copy_that_fills_the_node_disk_fails_the_save_and_keeps_the_earlier_step(small_disk, tmp_path):
    model = torch.nn.Linear(64, 64)
    manager = skc.CheckpointManager(str(tmp_path / "durable"), local=str(small_disk / "node{node}"), replicas=0,
                                    durable_every=100)
    manager.save(1, model)
    manager.wait()
    with open(small_disk / "filler", "wb") as f:  # another tenant of the node's disk takes what is left
        try:
            f.write(os.urandom(1 << 20))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    with pytest.raises(CheckpointOSError) as raised:
        manager.save(2, model)
        manager.wait()
    _assert_enospc(raised.value)
    os.remove(small_disk / "filler")
    resumed = torch.nn.Linear(64, 64)
    fresh = skc.CheckpointManager(str(tmp_path / "durable"), local=str(small_disk / "node{node}"), replicas=0,
                                  durable_every=100)
    assert fresh.load_latest(resumed) == (1, None) and fresh.last_load.source == "local"
    assert torch.equal(resumed.weight, model.weight) and torch.equal(resumed.bias, model.bias)
    [run] = [n for n in os.listdir(small_disk / "node0") if n.startswith("run-")]
    assert _files_under(str(small_disk / "node0" / run / "step-0000000002")) == []  # this save's copy removed


def test_reshard_into_a_full_disk_exits_with_one_enospc_line_and_no_manifest(small_disk, tmp_path):
    src = str(tmp_path / "src")
    skc.save({"w": torch.randn(400_000, generator=torch.Generator().manual_seed(0)), "b": torch.zeros(4)}, src)
    dst = small_disk / "dst"
    result = run_cli("reshard", src, str(dst), "--world-size", "2")
    assert result.exit_code == 1, (result.stdout, result.stderr)
    [line] = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert FULL in line and str(dst) in line, line
    assert not (dst / "manifest.json").exists()
    assert [f for f in _files_under(str(dst)) if ".partial-" in f or ".tmp-" in f] == []
    assert skc.verify(src).ok


def _hot_save_until_full(root: str, disk: str) -> tuple[str, int | None, str, int | None]:
    """Two nodes of one rank; node 1's directory is the small disk, filled after step 1 by another tenant."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(os.path.join(root, "hot"), exist_ok=True)
        os.symlink(disk, os.path.join(root, "hot", "node1"))
    dist.barrier()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    manager = skc.CheckpointManager(os.path.join(root, "durable"), local=os.path.join(root, "hot", "node{node}"),
                                    local_world_size=1, replicas=1, durable_every=100)
    manager.save(1, model)
    manager.wait()
    dist.barrier()
    if rank == 1:
        with open(os.path.join(disk, "filler"), "wb") as f:
            try:
                f.write(os.urandom(1 << 20))
            except OSError:
                pass
    dist.barrier()
    try:
        manager.save(2, model)
        manager.wait()
    except Exception as exc:  # noqa: BLE001 - what the test inspects
        caught = exc
    else:
        raise AssertionError("a hot save larger than the node's disk did not fail")
    dist.barrier()
    if rank == 1:
        os.remove(os.path.join(disk, "filler"))
    dist.barrier()
    fresh = skc.CheckpointManager(os.path.join(root, "durable"), local=os.path.join(root, "hot", "node{node}"),
                                  local_world_size=1, replicas=1, durable_every=100)
    resumed = torch.nn.Linear(64, 64)
    assert fresh.load_latest(resumed) == (1, None)
    assert torch.equal(resumed.weight, model.weight) and torch.equal(resumed.bias, model.bias)
    return type(caught).__name__, getattr(caught, "errno", None), str(caught), fresh.last_load.source


def test_a_hot_save_whose_node_disk_fills_fails_on_every_rank_with_enospc(small_disk, tmp_path):
    per_rank = run_on_ranks(2, _hot_save_until_full, str(tmp_path / "run"), str(small_disk))
    for rank, (kind, code, message, source) in enumerate(per_rank):
        assert (kind, code) == ("CheckpointOSError", errno.ENOSPC), (rank, kind, message)
        assert "no space left on device" in message.lower(), message
        assert source == "local"
