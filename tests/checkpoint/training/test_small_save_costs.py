"""What a small save no longer pays for, with every guarantee kept: the commit's outcome (and any small
JSON answer) arrives in one broadcast of a fixed frame, not a length and then the bytes; the ranks' reports
reach rank 0 in one gather and a small exchange is one all-gather; a large answer, report or payload still
arrives whole; and a small sharded state still saves and loads back bitwise on two gloo ranks."""

from __future__ import annotations

import os

import torch

from shardkit.checkpoint import load, save
from shardkit.checkpoint.io.dist import Dist
from tests.support.dist import run_on_ranks


def _state(total_bytes: int, tensors: int = 8) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    rows = total_bytes // 4 // tensors // 64
    return {f"layer{i}.weight": torch.randn(rows, 64, generator=gen) for i in range(tensors)}


def _collectives_on_two_ranks() -> dict:
    import torch.distributed as dist

    d = Dist()
    rank = dist.get_rank()
    small = d.broadcast_json({"from": rank} if rank == 0 else None)
    big_value = {"keys": [f"model.layers.{i}.weight" for i in range(2000)]} if rank == 1 else None
    big = d.broadcast_json(big_value, src=1)
    return {"small": small, "big_len": len(big["keys"]), "big_last": big["keys"][-1]}


def test_a_small_json_broadcast_arrives_in_one_frame_and_a_large_one_in_two_on_two_gloo_ranks():
    per_rank = run_on_ranks(2, _collectives_on_two_ranks)
    for got in per_rank:
        assert got == {"small": {"from": 0}, "big_len": 2000, "big_last": "model.layers.1999.weight"}


def _gathers_counted_on_three_ranks() -> dict:
    import torch.distributed as dist

    calls: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in ("gather", "all_gather", "isend", "irecv")}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counted(name))
    try:
        d, rank = Dist(), dist.get_rank()
        small = d.gather_json({"rank": rank})
        small_calls, calls_before = dict(calls), sum(calls.values())
        big = d.gather_json({"rank": rank, "keys": [f"model.layers.{i}.weight" for i in range(6000)] if rank == 2
                             else []})
        everyone = d.all_gather_json({"rank": rank, "pad": "x" * (100_000 if rank == 1 else rank)})
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"small": small, "small_calls": small_calls, "big_calls": sum(calls.values()) - calls_before,
            "big": None if big is None else [(g["rank"], len(g["keys"]), g["keys"][-1:]) for g in big],
            "everyone": [(g["rank"], len(g["pad"])) for g in everyone]}


def test_reports_gather_in_one_collective_and_a_long_one_arrives_whole_on_three_gloo_ranks():
    per_rank = run_on_ranks(3, _gathers_counted_on_three_ranks)
    assert per_rank[0]["small"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert [got["small"] for got in per_rank[1:]] == [None, None]
    assert all(got["small_calls"] == {"gather": 1} for got in per_rank)
    assert per_rank[0]["big"] == [(0, 0, []), (1, 0, []), (2, 6000, ["model.layers.5999.weight"])]
    assert all(got["everyone"] == [(0, 0), (1, 100_000), (2, 2)] for got in per_rank)
    # the long report travels once more, point to point (rank 2 -> rank 0); the long payload in one more
    # all-gather that every rank joins
    assert [got["big_calls"] for got in per_rank] == [1 + 1 + 2, 1 + 2, 1 + 1 + 2]


def _save_dtensors_and_count_files(path: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = _state(2 << 20)
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    save(state, path, io_threads=4)
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
    load(target, path)
    same = all(torch.equal(target[k].full_tensor(), full[k]) for k in full)
    dist.barrier()
    return {"files": sorted(n for n in os.listdir(os.path.join(path, "data")) if n.endswith(".safetensors")),
            "same": same}


def test_a_small_sharded_state_saved_by_two_gloo_ranks_each_writing_its_half_loads_back_bitwise(tmp_path):
    per_rank = run_on_ranks(2, _save_dtensors_and_count_files, str(tmp_path / "ck"))
    assert all(got["same"] for got in per_rank)
    assert {name.split("-")[1] for name in per_rank[0]["files"]} == {"0", "1"}


def _phases_of_two_saves(path: str, indexed_from: int) -> dict:
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardkit.checkpoint.formats.native import index

    mesh = init_device_mesh("cpu", (2,))
    full = _state(1 << 20)
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    phases: list[list[str]] = []
    arrive = Dist.arrive

    def recorded(self, phase=None):
        phases[-1].append(phase or self.phase)
        return arrive(self, phase)

    old, index.INDEXED_FROM_CHUNKS = index.INDEXED_FROM_CHUNKS, indexed_from
    Dist.arrive = recorded
    try:
        for step in (1, 2):
            phases.append([])
            save(state, f"{path}/step{step}", chunk_bytes=64 << 10)
    finally:
        Dist.arrive, index.INDEXED_FROM_CHUNKS = arrive, old
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
    load(target, f"{path}/step2")
    with open(f"{path}/step2/manifest.json") as f:
        version = json.load(f)["version"]
    dist.barrier()
    return {"phases": phases, "same": all(torch.equal(target[k].full_tensor(), full[k]) for k in full),
            "version": version}


def test_a_repeated_small_save_meets_three_times_and_a_large_one_still_counts_its_chunks_first(tmp_path):
    small = run_on_ranks(2, _phases_of_two_saves, str(tmp_path / "small"), 4096)
    for got in small:
        # the first save exchanges every rank's boxes and counts the chunks written; the second agrees in one
        # all-reduce that nothing changed, which also says how few chunks any rank writes
        assert got["phases"][1] == ["plan", "write", "commit"]
        assert got["phases"][0] in (["plan", "plan", "write", "commit", "commit"], ["plan", "write", "commit"])
        assert got["same"] and got["version"] != 3
    large = run_on_ranks(2, _phases_of_two_saves, str(tmp_path / "large"), 8)  # 8+ chunks: index files
    for got in large:
        assert got["phases"][1] == ["plan", "write", "commit", "commit"]
        assert got["same"] and got["version"] == 3


def test_a_small_state_goes_into_one_data_file_per_rank_and_a_large_one_into_one_per_io_thread(tmp_path):
    small, large = _state(2 << 20, tensors=4), _state(24 << 20, tensors=12)
    save(small, str(tmp_path / "small"), io_threads=4)
    save(large, str(tmp_path / "large"), io_threads=4)
    assert len(os.listdir(tmp_path / "small" / "data")) == 1  # 2 MiB: one create, one fsync
    assert len(os.listdir(tmp_path / "large" / "data")) == 3  # 24 MiB: three files of 8 MiB, three threads
    for name, state in (("small", small), ("large", large)):
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        load(back, str(tmp_path / name))
        assert all(torch.equal(back[k], state[k]) for k in state)


def _phases_of_alternating_saves(path: str) -> list[list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = _state(1 << 20)
    training = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    export = {k: v for k, v in list(training.items())[:3]}  # e.g. the model alone, between training saves
    phases: list[list[str]] = []
    arrive = Dist.arrive

    def recorded(self, phase=None):
        phases[-1].append(phase or self.phase)
        return arrive(self, phase)

    Dist.arrive = recorded
    try:
        for step, state in enumerate((training, export, training, export, training)):
            phases.append([])
            save(state, f"{path}/step{step}")
    finally:
        Dist.arrive = arrive
    return phases


def test_saves_that_alternate_two_structures_each_reuse_their_own_plan(tmp_path):
    for phases in run_on_ranks(2, _phases_of_alternating_saves, str(tmp_path)):
        assert phases[2:] == [["plan", "write", "commit"]] * 3


def test_new_plain_tensors_each_save_reuse_the_plan_but_a_tie_between_them_is_still_seen(tmp_path, monkeypatch):
    import json

    from shardkit.checkpoint.training import save_planning as save_module

    derived = []  # planning afresh looks for tied keys first
    real = save_module.find_aliases
    monkeypatch.setattr(save_module, "find_aliases", lambda *a: derived.append(1) or real(*a))

    def step_state(tied: bool) -> dict:  # a training state's RNG bytes and step counts: new tensors every time
        rng = torch.arange(16, dtype=torch.uint8)
        return {"rng.cpu": rng, "rng.copy": rng if tied else rng.clone(), "step": torch.tensor(3.0)}

    for step, tied in enumerate((False, False, False, True, False)):
        save(step_state(tied), str(tmp_path / f"s{step}"))
        with open(tmp_path / f"s{step}" / "manifest.json") as f:
            assert json.load(f).get("aliases", {}) == ({"rng.copy": "rng.cpu"} if tied else {})
    assert len(derived) == 2  # the first save, and the one whose two keys share a storage


def _padded_gather_on_three_ranks() -> list | None:
    import torch.distributed as dist

    cheap = Dist.point_to_point_is_cheap
    Dist.point_to_point_is_cheap = property(lambda self: False)  # NCCL's path, on gloo
    try:
        d, rank = Dist(), dist.get_rank()
        return d.gather_json({"rank": rank, "keys": ["k"] * (rank * 3000)})
    finally:
        Dist.point_to_point_is_cheap = cheap


def test_the_padded_gather_nccl_takes_gives_every_rank_payload_whole_on_rank_0():
    per_rank = run_on_ranks(3, _padded_gather_on_three_ranks)
    assert [(g["rank"], len(g["keys"])) for g in per_rank[0]] == [(0, 0), (1, 3000), (2, 6000)]
    assert per_rank[1:] == [None, None]
