"""Save at one world size, load at any other: bitwise state, identical continued training, interop."""

from __future__ import annotations

import random

import pytest
import torch

import shardkit.checkpoint as skc
from tests.support.checkpoint_helpers import (
    build_model,
    full_state,
    make_mesh,
    make_optimizer,
    mismatches,
    rel_close,
    train,
    world,
)
from tests.support.dist import run_on_ranks

# --------------------------------------------------------------------------
# must-show 1: train 5 steps at world size 2, resume anywhere


def _train_save_continue(url: str, kind: str = "shardkit"):
    """Train 5 steps, save, record the full state, train 5 more (the uninterrupted run)."""
    model = build_model(kind, seed=0)
    opt = make_optimizer(model)
    first = train(model, opt, range(5))
    skc.save(skc.get_training_state(model, opt), url, meta={"step": 5})
    saved = full_state(model, opt)
    rest = train(model, opt, range(5, 10))
    return {"losses": first + rest, "saved": saved}


def _resume(url: str, kind: str = "shardkit", mesh_shape: tuple[int, ...] | None = None):
    """Fresh model (other seed) and fresh optimizer, load, compare state, train 5 more steps."""
    model = build_model(kind, seed=123, mesh_shape=mesh_shape)
    opt = make_optimizer(model)
    sd = skc.get_training_state(model, opt)
    meta = skc.load(sd, url)
    skc.set_training_state(model, opt, sd)
    loaded = full_state(model, opt)
    return {"meta": meta, "loaded": loaded, "losses": train(model, opt, range(5, 10))}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("reshard") / "step-5")
    out = run_on_ranks(2, _train_save_continue, url)
    return url, out[0]


@pytest.mark.parametrize("world_size,mesh_shape", [(1, None), (3, None), (4, None), (4, (2, 2))],
                         ids=["ws1", "ws3", "ws4", "hsdp2x2"])
def test_two_rank_training_resumes_bitwise_at_another_world_size(two_rank_run, world_size, mesh_shape):
    url, reference = two_rank_run
    out = run_on_ranks(world_size, _resume, url, "shardkit", mesh_shape)
    assert out[0]["meta"] == {"step": 5}
    assert mismatches(reference["saved"], out[0]["loaded"]) == []
    # every model tensor and every AdamW state (exp_avg, exp_avg_sq, step) was compared
    keys = reference["saved"]["tensors"].keys()
    assert any(k.endswith(".exp_avg_sq") for k in keys) and any(k.endswith(".step") for k in keys)
    assert all(o["losses"] == out[0]["losses"] for o in out)
    assert rel_close(out[0]["losses"], reference["losses"][5:]), (out[0]["losses"], reference["losses"][5:])


def test_plain_module_in_one_process_loads_the_two_rank_checkpoint(two_rank_run):
    url, reference = two_rank_run
    model = build_model("plain", seed=7)
    opt = make_optimizer(model)
    sd = skc.get_training_state(model, opt)
    skc.load(sd, url)
    skc.set_training_state(model, opt, sd)
    assert mismatches(reference["saved"], full_state(model, opt)) == []
    assert rel_close(train(model, opt, range(5, 10)), reference["losses"][5:])


# --------------------------------------------------------------------------
# must-show 2: interop with torch's own fully_shard


def test_checkpoint_from_torch_fully_shard_loads_into_shardkit_at_three_ranks(tmp_path):
    url = str(tmp_path / "torch-ws2")
    reference = run_on_ranks(2, _train_save_continue, url, "torch")[0]
    out = run_on_ranks(3, _resume, url, "shardkit")
    assert mismatches(reference["saved"], out[0]["loaded"]) == []
    assert rel_close(out[0]["losses"], reference["losses"][5:])


def test_checkpoint_from_shardkit_at_three_ranks_loads_into_torch_fully_shard_at_two(tmp_path):
    url = str(tmp_path / "shardkit-ws3")
    reference = run_on_ranks(3, _train_save_continue, url, "shardkit")[0]
    out = run_on_ranks(2, _resume, url, "torch")
    assert mismatches(reference["saved"], out[0]["loaded"]) == []
    assert rel_close(out[0]["losses"], reference["losses"][5:])


# --------------------------------------------------------------------------
# property: full -> sharded(N) -> sharded(M) -> full, bitwise


def _random_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Uneven shapes (sizes below, at and above 4 ranks, zero-size), several dtypes."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(10):
        shape = tuple(rng.choice([1, 2, 3, 5, 7, 9, 13]) for _ in range(rng.choice([1, 2, 2, 3])))
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.float16])
        out[f"t{i}"] = (torch.randn(shape, generator=gen) * 100).to(dtype)
    out["empty"] = torch.empty(0, 6)
    out["scalar"] = torch.tensor(2.5)
    return out


def _placements_for(t: torch.Tensor, mesh_ndim: int, rng: random.Random):
    from torch.distributed.tensor import Replicate, Shard

    options = [Replicate()] + [Shard(d) for d in range(t.dim())]
    return [rng.choice(options) for _ in range(mesh_ndim)]


def _distribute(tensors: dict[str, torch.Tensor], mesh_shape: tuple[int, ...], seed: int):
    from torch.distributed.tensor import distribute_tensor

    mesh = make_mesh(mesh_shape)
    rng = random.Random(seed)
    return {k: (distribute_tensor(t, mesh, _placements_for(t, len(mesh_shape), rng)) if t.dim() else t.clone())
            for k, t in tensors.items()}


def _save_sharded(url: str, mesh_shape: tuple[int, ...], seed: int, compression):
    sd = {"model": _distribute(_random_tensors(seed), mesh_shape, seed), "extra": {"seed": seed}}
    skc.save(sd, url, compression=compression, chunk_bytes=1024, block_bytes=16)


def _load_everything(urls_and_seeds, mesh_shape: tuple[int, ...]):
    """Load every checkpoint into zeroed DTensors laid out anew; return the mismatching keys per checkpoint."""
    from shardkit.checkpoint.state.training_state import gather_full_tensor

    bad = {}
    for url, seed in urls_and_seeds:
        originals = _random_tensors(seed)
        targets = _distribute({k: torch.zeros_like(v) for k, v in originals.items()}, mesh_shape, seed + 1000)
        sd = {"model": targets, "extra": {"seed": -1}}
        skc.load(sd, url)
        wrong = [k for k, v in targets.items()
                 if not torch.equal(gather_full_tensor(v, rank0_only=False), originals[k])]
        if sd["extra"]["seed"] != seed:
            wrong.append("extra")
        bad[url] = wrong
    return bad


MESHES = {1: [(1,)], 2: [(2,)], 3: [(3,)], 4: [(4,), (2, 2)]}


def test_full_to_sharded_n_to_sharded_m_to_full_is_bitwise_for_n_and_m_in_1_to_4(tmp_path):
    saved = []
    for n in (1, 2, 3, 4):
        for j, mesh_shape in enumerate(MESHES[n]):
            seed = 10 * n + j
            url = str(tmp_path / f"n{n}-{j}")
            run_on_ranks(n, _save_sharded, url, mesh_shape, seed, "zstd" if seed % 3 == 0 else None)
            saved.append((url, seed))
    for m in (1, 2, 3, 4):
        for mesh_shape in MESHES[m]:
            results = run_on_ranks(m, _load_everything, saved, mesh_shape)
            for per_rank in results:
                assert all(wrong == [] for wrong in per_rank.values()), (m, mesh_shape, per_rank)


def _resharded_read_amplification(url: str):
    """Load a two-rank Shard(0) checkpoint of large-ish tensors at this world size; bytes read / needed."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardkit.checkpoint.formats.native.reader import NativeReader

    mesh = make_mesh((world()[1],))
    shapes = {"emb": (1000, 64), "w1": (517, 128), "w2": (128, 517), "b": (517,)}
    sd = {k: distribute_tensor(torch.zeros(s), mesh, [Shard(0)]) for k, s in shapes.items()}
    reader = NativeReader(url)
    from shardkit.checkpoint.state.tree import flatten
    from shardkit.checkpoint.training.load_planning import plan_load

    requests = plan_load(reader, flatten(sd), True).requests
    reader.read(requests)
    return reader.stats.bytes_read, reader.stats.bytes_needed


def _save_large(url: str):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = make_mesh((world()[1],))
    gen = torch.Generator().manual_seed(3)
    shapes = {"emb": (1000, 64), "w1": (517, 128), "w2": (128, 517), "b": (517,)}
    sd = {k: distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)]) for k, s in shapes.items()}
    skc.save(sd, url, chunk_bytes=64 << 10, block_bytes=4 << 10)


def test_resharded_loads_read_at_most_ten_percent_more_than_they_need(tmp_path):
    url = str(tmp_path / "large")
    run_on_ranks(2, _save_large, url)
    for m in (1, 3, 4):
        stats = run_on_ranks(m, _resharded_read_amplification, url)
        read, needed = sum(s[0] for s in stats), sum(s[1] for s in stats)
        assert needed == (1000 * 64 + 517 * 128 * 2 + 517) * 4
        assert read / needed <= 1.1, (m, read / needed)
