"""Letting go of an opened hot copy (training/hot/copies.py, ``CheckedCopy.discard``): a copy read whole -- a
mapping of tens of MB -- is released off the recovering thread; a pending copy, whose bytes went straight
into the targets and which holds only its input state's few small tensors, is let go of at once, with no
thread started (on a busy machine ``Thread.start`` waits for the new thread to be scheduled: once 25 ms of a
75 MB recovery)."""

from __future__ import annotations

import torch

import shardkit.checkpoint.training.hot.copies as copies
from shardkit.checkpoint.state.tree import flatten
from shardkit.checkpoint.training.hot.flat import open_pending, read_flat, read_manifest, write_flat


def _copy(tmp_path) -> tuple[str, torch.Tensor]:
    weight = torch.arange(600, dtype=torch.float32).reshape(20, 30)
    path = str(tmp_path / "rank-0.aaaaaaaaaaaa000001")
    write_flat(path, {"model.w": weight, "rng.cpu": torch.arange(8, dtype=torch.uint8)}, {}, {"hot": {}})
    return path, weight


def _released(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(copies, "release_in_background", lambda held: calls.append(list(held)))
    return calls


def test_a_pending_copy_is_let_go_of_without_a_thread(tmp_path, monkeypatch):
    path, weight = _copy(tmp_path)
    calls = _released(monkeypatch)
    pending = open_pending(path, read_manifest(path), copies.is_input_key)
    target = torch.zeros_like(weight)
    checked = copies.CheckedCopy(pending, {"model.w": target}, flatten({"model": {"w": target}}))
    checked.apply()  # reads model.w straight into the target, then lets go of the copy
    assert torch.equal(target, weight)
    assert calls == [] and pending.tensors == {} and checked.targets == {}


def test_a_copy_read_whole_hands_its_mapped_tensors_to_the_background_release(tmp_path, monkeypatch):
    path, weight = _copy(tmp_path)
    calls = _released(monkeypatch)
    read = read_flat(path)
    target = torch.zeros_like(weight)
    copies.CheckedCopy(read, {"model.w": target}, flatten({"model": {"w": target}})).apply()
    assert torch.equal(target, weight)
    assert len(calls) == 1 and sorted(t.numel() for t in calls[0]) == [8, 600] and read.tensors == {}
