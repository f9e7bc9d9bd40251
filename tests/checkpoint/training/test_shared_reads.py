"""Loads where several ranks need the same bytes read them from storage once.

A checkpoint is loaded at HSDP 2x2 (``(Replicate(), Shard(0))`` on a (2, 2)
mesh): the two replicas of every shard need identical bytes.  One rank of each
pair reads them (checking every checksum block it reads) and sends them to the
other, so the data bytes all four ranks ask of storage add up to the
checkpoint once per pass -- where four ranks each reading their own asked
for it twice per pass.  The default load is one pass; the all-or-nothing one
(``verify_first=True``) checks the bytes in staging memory before any rank
writes a target, so it too reads each byte once.  Counted at the storage
layer, per rank.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.dist import run_on_ranks
from tests.support.read_sharing import sharing_every_read

SHAPES = {"model.emb": (101, 64), "model.w": (37, 26), "model.b": (26,), "optim.step": ()}


def _truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _data_bytes() -> int:
    return sum(math.prod(s) * 4 for s in SHAPES.values())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import shardkit.checkpoint as skc

    url = str(tmp_path_factory.mktemp("shared") / "ck")
    skc.save(_truth(), url, block_bytes=512)
    return url


def _count_data_reads(monkeypatch_storage: list[int]):
    from shardkit.checkpoint.io.storage import Storage

    read_parts, read_bytes = Storage.read_parts, Storage.read_bytes

    def counted_parts(self, name, start, parts):
        if name.startswith("data/"):
            monkeypatch_storage[0] += sum(p.numel() for p in parts)
        return read_parts(self, name, start, parts)

    def counted_bytes(self, name, start=None, end=None):
        data = read_bytes(self, name, start, end)
        if name.startswith("data/") and start:  # from byte 0: the file's header, checked like the manifest
            monkeypatch_storage[0] += len(data)
        return data

    Storage.read_parts, Storage.read_bytes = counted_parts, counted_bytes
    return lambda: setattr(Storage, "read_parts", read_parts) or setattr(Storage, "read_bytes", read_bytes)


def _load_at_hsdp(url: str, verify_first: bool, staging_bytes: int | None) -> tuple[int, bool]:
    """(data bytes this rank asked of storage, whether every target equals the saved tensor bitwise)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardkit.checkpoint as skc

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    sd = {k: distribute_tensor(torch.zeros(s), mesh, [Replicate(), Shard(0)]) if s else torch.zeros(())
          for k, s in SHAPES.items()}
    counter = [0]
    restore = _count_data_reads(counter)
    try:
        with sharing_every_read():  # these few bytes too
            skc.load(sd, url, verify_first=verify_first, staging_bytes=staging_bytes)
    finally:
        restore()
    truth = _truth()
    same = all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, truth[k]) for k, v in sd.items())
    return counter[0], same


@pytest.mark.parametrize("verify_first,staging_bytes,reads", [
    (True, None, 1.0),  # all or nothing: checked in staging memory, so still read once
    (False, None, 1.0),  # the default: one pass straight into the targets, checked as the bytes land
    (True, 0, 2.0),  # checked without staging memory: a checking pass, then the read
    (True, 2 * 40 * 16 * 4, (1.0, 2.0)),  # staging for a part: that part once, the rest twice
], ids=["staged", "one-pass", "no-staging", "some-staging"])
def test_hsdp_2x2_reads_each_byte_from_storage_once_and_loads_bitwise(saved, verify_first, staging_bytes, reads):
    results = run_on_ranks(4, _load_at_hsdp, saved, verify_first, staging_bytes)
    assert all(same for _, same in results)
    total = sum(n for n, _ in results)
    # each replica reading its own would ask for 2x the checkpoint per pass
    low, high = reads if isinstance(reads, tuple) else (reads, reads)
    assert total <= 1.05 * high * _data_bytes(), (total, _data_bytes())
    assert total > 1.05 * low * _data_bytes() or low == high, (total, _data_bytes())
    assert all(n > 0 for n, _ in results)  # the work is spread: every rank reads some of it


def _load_with_a_damaged_share(url: str) -> tuple[str, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardkit.checkpoint as skc

    mesh = init_device_mesh("cpu", (2, 2))
    sd = {k: distribute_tensor(torch.full(s, 7.0), mesh, [Replicate(), Shard(0)]) if s else torch.full((), 7.0)
          for k, s in SHAPES.items()}
    try:
        with sharing_every_read():
            skc.load(sd, url, verify_first=True)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        name = type(exc).__name__
    else:
        name = "loaded"
    untouched = all(bool((v.to_local() if hasattr(v, "to_local") else v).eq(7.0).all()) for v in sd.values())
    return name, untouched


def test_a_flipped_byte_in_a_shared_read_fails_every_rank_and_no_target_is_written(saved, tmp_path):
    import json
    import shutil

    url = tmp_path / "ck"
    shutil.copytree(saved, url)
    manifest = json.loads((url / "manifest.json").read_text())
    chunk = manifest["tensors"]["model.emb"]["chunks"][0]
    path = url / chunk["file"]
    data = bytearray(path.read_bytes())
    data[chunk["start"] + 10] ^= 0x01
    path.write_bytes(bytes(data))
    assert run_on_ranks(4, _load_with_a_damaged_share, str(url)) == [("ChecksumMismatch", True)] * 4
