"""A peer's hot copy received into memory (training/hot/fetch.py): bitwise what the holder wrote, every byte's
crc32c checked as it arrives, nothing written to any disk, and a damaged or unreadable copy a reason -- never
a hang -- on both ends."""

from __future__ import annotations

import os

import torch

from shardkit.checkpoint.io.transfer_files import list_directory
from shardkit.checkpoint.training.hot.flat import DATA_NAME, MANIFEST_NAME, read_manifest, write_flat
from tests.support.dist import run_on_ranks

COPY = "rank-1.aaaaaaaaaaaa000001"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"model.w": torch.randn(300, 70, generator=g), "model.h": torch.randn(9, 4, generator=g).bfloat16(),
            "model.empty": torch.empty(0, 3), "optim.state.0.step": torch.tensor(5.0),
            "rng.rank1.cpu": torch.arange(11, dtype=torch.uint8)}


def _holder_copy(root: str) -> str:
    path = os.path.join(root, "node0", COPY)
    write_flat(path, _tensors(), {"optim.param_groups.0.lr": 0.25}, {"hot": {"step": 7, "rank": 1}})
    return path


def _flip(path: str, key: str) -> None:
    offset = next(e[3] for e in read_manifest(path)["tensors"] if e[0] == key)
    with open(os.path.join(path, DATA_NAME), "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))


def _fetch(root: str, chunk: int, damage: str | None) -> dict:
    """Rank 0 holds rank 1's copy and sends it in chunks of ``chunk`` bytes; ``damage``: ``"byte"`` flips a
    byte of ``model.w`` after the listing, ``"gone"`` removes the copy after it, ``"size"`` lists the data
    file one byte longer than it is."""
    import torch.distributed as dist

    import shardkit.checkpoint.training.hot.fetch as fetch

    fetch.CHUNK_BYTES = chunk
    path = os.path.join(root, "node0", COPY)
    if dist.get_rank() == 0:
        _holder_copy(root)
    dist.barrier()
    files = list_directory(path, MANIFEST_NAME)
    if damage == "size":
        files = [(n, s + 1 if n == DATA_NAME else s) for n, s in files]
    dist.barrier()
    if dist.get_rank() == 0 and damage == "byte":
        _flip(path, "model.w")
    if dist.get_rank() == 0 and damage == "gone":
        os.rename(path, path + ".moved")
    got = fetch.fetch_copies([fetch.Pull(0, path, 1, files)])
    out = {"problem": got.problem, "failed_sends": got.failed_sends}
    if got.copy is not None:
        out.update(same=all(torch.equal(got.copy.tensors[k], t) for k, t in _tensors().items()),
                   keys=sorted(got.copy.tensors), values=got.copy.values, meta=got.copy.meta)
    dist.barrier()
    out["files"] = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names)
    return out


def test_a_peers_copy_arrives_bitwise_in_memory_and_nothing_is_written_to_disk(tmp_path):
    for chunk in (64, 4096, 8 << 20):  # many chunks (tensors checked as their last chunk lands), one chunk
        root = str(tmp_path / str(chunk))
        holder, receiver = run_on_ranks(2, _fetch, root, chunk, None)
        assert holder == {"problem": None, "failed_sends": {}, "files": holder["files"]}
        assert receiver["problem"] is None and receiver["same"] is True
        assert receiver["keys"] == sorted(_tensors())
        assert receiver["values"] == {"optim.param_groups.0.lr": 0.25}
        assert receiver["meta"] == {"hot": {"step": 7, "rank": 1}}
        assert receiver["files"] == sorted([f"node0/{COPY}/{DATA_NAME}", f"node0/{COPY}/{MANIFEST_NAME}"])


def test_a_flipped_byte_is_refused_by_the_receiver_naming_the_holder_and_the_key(tmp_path):
    holder, receiver = run_on_ranks(2, _fetch, str(tmp_path), 4096, "byte")
    assert holder["failed_sends"] == {}  # the holder read it as it is: the receiver's check finds the damage
    assert "keys" not in receiver
    assert "rank 0's" in receiver["problem"] and "'model.w'" in receiver["problem"]
    assert "checksum" in receiver["problem"]


def test_a_copy_gone_or_not_as_listed_fails_on_both_ends_without_a_hang(tmp_path):
    for damage in ("gone", "size"):
        holder, receiver = run_on_ranks(2, _fetch, str(tmp_path / damage), 4096, damage)
        path = os.path.join(str(tmp_path / damage), "node0", COPY)
        assert list(holder["failed_sends"]) == [path]
        assert "rank 0 cannot send" in holder["failed_sends"][path]
        assert "keys" not in receiver and receiver["problem"]  # zeros arrived: refused, never trusted


def _released(root: str) -> dict:
    """A fetch of rank 1's copy from rank 0, recording what each rank hands to the background release."""
    import torch.distributed as dist

    import shardkit.checkpoint.training.hot.fetch as fetch

    handed: list = []
    release, fetch.release_in_background = fetch.release_in_background, handed.extend  # kept here, to look at
    path = os.path.join(root, "node0", COPY)
    try:
        if dist.get_rank() == 0:
            _holder_copy(root)
        dist.barrier()
        got = fetch.fetch_copies([fetch.Pull(0, path, 1, list_directory(path, MANIFEST_NAME))])
    finally:
        fetch.release_in_background = release  # the ranks' processes serve the next test too
    sent = [piece for pieces in handed for piece in pieces]
    return {"problem": got.problem, "sent_bytes": sum(p.numel() for p in sent),
            "data_bytes": os.path.getsize(os.path.join(path, DATA_NAME)),
            "same": got.copy is None or all(torch.equal(got.copy.tensors[k], t) for k, t in _tensors().items())}


def test_the_holder_hands_the_mapped_pieces_it_sent_to_the_background_release(tmp_path):
    holder, receiver = run_on_ranks(2, _released, str(tmp_path))
    assert holder["sent_bytes"] == holder["data_bytes"] > 0  # every piece of its mapped copy, none kept
    assert receiver["sent_bytes"] == 0 and receiver["problem"] is None and receiver["same"] is True
