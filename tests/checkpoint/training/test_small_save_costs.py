"""What a small save no longer pays for, with every guarantee kept: the commit's outcome (and any small
JSON answer) arrives in one broadcast of a fixed frame, not a length and then the bytes; a large answer
still arrives whole; and a small sharded state still saves and loads back bitwise on two gloo ranks."""

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
