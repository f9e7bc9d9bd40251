"""What a rank holds of a DTensor on any mesh, and that save writes each stored element exactly once.

The box rule is checked three ways: against FSDP2 + TP's own nesting (a TP
shard, then FSDP's chunk of it), against the data torch's ``distribute_tensor``
puts on each rank (bitwise), and against torch's
``compute_local_shape_and_global_offset`` where a rank holds one box -- and
shown to differ from it where a strided rank holds several.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.checkpoint.geometry.boxes import check_cover, shard_range
from shardkit.checkpoint.geometry.placements import held_pieces, held_runs, placement_specs
from shardkit.errors import IncompatibleStateDict
from tests.support.dist import run_on_ranks


def _fsdp_over_tp_rows(n: int, dp: int, tp: int, d: int, t: int) -> list[tuple[int, int]]:
    """The rows FSDP2 + TP hold at (d, t): TP's Shard(0) piece t, then FSDP's chunk d of that piece."""
    lo, hi = shard_range(n, tp, t)
    a, b = shard_range(hi - lo, dp, d)
    return [(lo + a, b - a)] if b > a else []


@pytest.mark.parametrize("dp,tp", [(2, 2), (1, 4), (4, 1), (1, 2), (2, 1)])
def test_strided_fsdp_over_tp_holds_the_rows_fsdp_and_tp_nest_to(dp, tp):
    specs = [("strided", 0, tp) if tp > 1 else ("shard", 0), ("shard", 0)]
    for n in range(0, 80):
        for d in range(dp):
            for t in range(tp):
                assert held_runs((n,), (dp, tp), (d, t), specs)[0] == _fsdp_over_tp_rows(n, dp, tp, d, t), (n, d, t)


def test_a_strided_rank_may_hold_several_row_ranges():
    # (_StridedShard(0, sf=2), Replicate()) on (2, 2): rows [0, 10) and [19, 28) of 37, local rows 0-9 and 10-18
    assert held_pieces((37, 26), (2, 2), (0, 1), [("strided", 0, 2), ("replicate",)]) == [
        (((0, 0), (10, 26)), ((0, 0), (10, 26))),
        (((19, 0), (9, 26)), ((10, 0), (9, 26)))]
    # the pieces of all coordinates tile the tensor exactly once (replicas aside)
    boxes = [g for d in range(2) for g, _ in held_pieces((37, 26), (2, 2), (d, 0), [("strided", 0, 2), ("replicate",)])]
    assert check_cover((37, 26), boxes) is None


@pytest.mark.parametrize("mesh", [(2, 2), (3, 2), (2, 1, 3)])
def test_pieces_of_every_coordinate_tile_the_tensor_for_mixed_placements(mesh):
    choices = [("replicate",), ("shard", 0), ("shard", 1), ("strided", 0, 2), ("strided", 1, 3), ("strided", 0, 3)]
    shape = (37, 26)
    for specs in itertools.product(choices, repeat=len(mesh)):
        boxes = {}
        for coord in itertools.product(*(range(k) for k in mesh)):
            for g, _ in held_pieces(shape, mesh, coord, specs):
                boxes[g] = None  # replicas hold equal boxes
        assert check_cover(shape, list(boxes)) is None, specs


def test_partial_and_unknown_placements_are_refused_naming_the_key():
    from torch.distributed.tensor import Partial, Shard

    with pytest.raises(IncompatibleStateDict, match=r"'model\.w' has a Partial placement"):
        placement_specs([Shard(0), Partial()], 2, "model.w")
    with pytest.raises(IncompatibleStateDict, match=r"'model\.w': placement Shard\(dim=2\) shards dim 2"):
        placement_specs([Shard(2)], 2, "model.w")

    class Rowwise:  # a placement of some other library
        pass

    with pytest.raises(IncompatibleStateDict, match=r"'model\.w': placement .*Rowwise.* has no box rule"):
        placement_specs([Rowwise()], 2, "model.w")


# --------------------------------------------------------------------------
# against the data torch puts on each rank (4 real ranks)

def _placement_cases():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {(2, 2): [[_StridedShard(0, split_factor=2), Replicate()], [_StridedShard(0, split_factor=2), Shard(0)],
                     [Shard(0), _StridedShard(0, split_factor=3)], [_StridedShard(0, split_factor=3), Shard(1)],
                     [Shard(1), Shard(0)], [Replicate(), Shard(1)]],
            (2, 1, 2): [[_StridedShard(0, split_factor=2), Replicate(), Shard(0)], [Shard(0), Shard(1), Shard(0)],
                        [Replicate(), Shard(0), _StridedShard(1, split_factor=2)]]}


def _pieces_hold_torch_data():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from shardkit.checkpoint.geometry.placements import local_pieces, view

    full = torch.arange(37 * 26, dtype=torch.float32).view(37, 26)
    out = []
    for mesh_shape, cases in _placement_cases().items():
        mesh = init_device_mesh("cpu", mesh_shape)
        for placements in cases:
            d = distribute_tensor(full, mesh, placements, src_data_rank=None)  # torch's own split, no scatter
            pieces = local_pieces(d, "t")
            same = all(torch.equal(view(d.to_local(), local), view(full, glob)) for glob, local in pieces)
            shape, offset = compute_local_shape_and_global_offset(d.shape, mesh, placements)
            torch_box = (tuple(offset), tuple(shape))
            out.append((str(placements), same, len(pieces), pieces[0][0] == torch_box if len(pieces) == 1 else
                        torch_box in [g for g, _ in pieces]))
    return out


def test_pieces_hold_exactly_the_data_torch_distributes_and_agree_with_torch_where_one_box():
    for rank_result in run_on_ranks(4, _pieces_hold_torch_data):
        for placements, same, n_pieces, torch_agrees in rank_result:
            assert same, placements
            if n_pieces == 1:
                assert torch_agrees, placements  # torch's one box is ours
            else:
                assert not torch_agrees, placements  # torch's first-offset box is not any box held


# --------------------------------------------------------------------------
# save writes each stored element once: replicas outside the tensor's mesh, on a 3-D mesh, strided pieces

SHAPES = {"emb": (97, 40), "w1": (51, 26), "w2": (26, 51), "b": (26,), "x3": (37, 5), "plain": (7,)}


def _save_mixed_layouts(url: str, background: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    gen = torch.Generator().manual_seed(0)
    full = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("rep", "dp", "tp"))
    sd = {"emb": distribute_tensor(full["emb"], mesh["dp"], [Shard(0)]),  # held alike by both tp ranks
          "w1": distribute_tensor(full["w1"], mesh, [_StridedShard(0, split_factor=2), Replicate()],
                                  src_data_rank=None),  # two row ranges per rank, replicated over tp
          "w2": distribute_tensor(full["w2"], mesh, [Shard(0), Shard(1)]),
          "b": distribute_tensor(full["b"], mesh, [Shard(0), Replicate()]),
          "x3": distribute_tensor(full["x3"], mesh3, [Replicate(), Shard(1), _StridedShard(0, split_factor=2)],
                                  src_data_rank=None),
          "plain": full["plain"]}
    if background:
        skc.async_save({"model": sd}, url, chunk_bytes=2048).result()
    else:
        skc.save({"model": sd}, url, chunk_bytes=2048)
    return full


def _load_mixed_layouts(url: str, full: dict[str, torch.Tensor]) -> list[str]:
    """Into strided targets holding several row ranges (``b`` cast to float64 on the way); the keys
    whose pieces do not hold exactly the saved values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardkit.checkpoint.geometry.placements import local_pieces, view

    mesh = init_device_mesh("cpu", (4,))
    sd = {k: distribute_tensor(torch.zeros(s), mesh, [_StridedShard(0, split_factor=3)], src_data_rank=None)
          for k, s in SHAPES.items() if k != "plain"}
    sd["w2"] = distribute_tensor(torch.zeros(26, 51), mesh, [Shard(1)])
    sd["b"] = distribute_tensor(torch.zeros(26, dtype=torch.float64), mesh, [_StridedShard(0, split_factor=3)],
                                src_data_rank=None)
    sd["plain"] = torch.zeros(7)
    skc.load({"model": sd}, url, dtype_cast=True)
    return [k for k, t in sd.items() if not all(torch.equal(view(t.to_local() if k != "plain" else t, loc),
                                                            view(full[k].to(t.dtype), glob))
                                                for glob, loc in local_pieces(t))]


@pytest.mark.parametrize("background", [False, True], ids=["save", "async_save"])
def test_each_element_is_written_once_whoever_holds_it_and_loads_into_strided_targets(tmp_path, background):
    url = str(tmp_path / "mixed")
    full = run_on_ranks(4, _save_mixed_layouts, url, background)[0]
    manifest = json.loads((tmp_path / "mixed" / "manifest.json").read_text())
    stored = {k.removeprefix("model."): sum(math.prod(c["shape"]) for c in t["chunks"])
              for k, t in manifest["tensors"].items()}
    assert stored == {k: v.numel() for k, v in full.items()}
    payload = sum(c["nbytes"] for t in manifest["tensors"].values() for c in t["chunks"])
    assert payload == sum(v.numel() * 4 for v in full.values())  # no byte written twice
    assert run_on_ranks(4, _load_mixed_layouts, url, full) == [[]] * 4
    layouts = {tuple(e["placements"]): e["mesh"] for e in manifest["writer"]["layouts"]}
    assert layouts[("_S(0, 2)", "R")] == {"shape": [2, 2], "dim_names": ["dp", "tp"]}
    assert layouts[("S(0)",)] == {"shape": [2], "dim_names": ["dp"]}
    assert manifest["writer"]["mesh"]["shape"] == [2, 1, 2]  # the widest mesh comes first


def _cut_and_copy_into_strided():
    """shard_full_tensor and copy_into for a target holding two row ranges: torch's own split, bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardkit.checkpoint.state.relayout import copy_into, shard_full_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(37 * 3, dtype=torch.float32).view(37, 3)
    placements = [_StridedShard(0, split_factor=2), Replicate()]
    expected = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
    like = distribute_tensor(torch.zeros(37, 3), mesh, placements, src_data_rank=None)
    cut = shard_full_tensor(full, like)
    copy_into(like, full, "t")
    return torch.equal(cut.to_local(), expected), torch.equal(like.to_local(), expected), cut.placements == \
        like.placements


def test_full_tensors_are_cut_into_strided_row_ranges_as_torch_splits_them():
    assert run_on_ranks(4, _cut_and_copy_into_strided) == [(True, True, True)] * 4


def _save_failing_on_rank_2(url: str):
    """Rank 2 alone holds a Partial tensor: its planning fails, the others must not wait for it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = init_device_mesh("cpu", (4,))
    placement = Partial() if torch.distributed.get_rank() == 2 else Shard(0)
    sd = {"model": {"x": DTensor.from_local(torch.ones(2), mesh, [placement], run_check=False)}}
    try:
        skc.save(sd, url)
    except IncompatibleStateDict as exc:
        return str(exc)
    return None


def test_a_planning_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    messages = run_on_ranks(4, _save_failing_on_rank_2, str(tmp_path / "one"), timeout=60)
    assert messages[2] == "'model.x' has a Partial placement (a pending reduction); redistribute it to " \
                          "Shard/Replicate before checkpointing"
    assert all(m is not None and "failed on rank 2" in m and "'model.x' has a Partial placement" in m
               for i, m in enumerate(messages) if i != 2), messages
    assert not (tmp_path / "one" / "manifest.json").exists()


def _save_partial(url: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (4,))
    pending = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    try:
        skc.save({"model": {"grad_sum": pending}}, url)
    except IncompatibleStateDict as exc:
        return str(exc)
    return None


def test_a_partial_dtensor_is_refused_on_every_rank_naming_the_key(tmp_path):
    messages = run_on_ranks(4, _save_partial, str(tmp_path / "partial"))
    assert all(m is not None and "'model.grad_sum' has a Partial placement" in m for m in messages), messages
    assert not (tmp_path / "partial" / "manifest.json").exists()
