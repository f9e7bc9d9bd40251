"""The padded cut of one parameter, checked against torch.chunk (the cut torch's fully_shard makes): each rank's
real rows, its padding, and the views of the all-gather's flat output that give back the full tensor."""

from __future__ import annotations

import pytest
import torch

from shardkit.errors import UnsupportedParameterLayoutError
from shardkit.runtime.shard_layout import ShardLayout


def _layouts(size: tuple[int, ...], shard_dim: int, world: int) -> list[ShardLayout]:
    return [ShardLayout.of(torch.Size(size), shard_dim, world, rank, "w") for rank in range(world)]


def _all_gather(full: torch.Tensor, layouts: list[ShardLayout]) -> torch.Tensor:
    """What the all-gather of every rank's padded shard returns: the shards back to back, rank-major."""
    shards = []
    for layout in layouts:
        padded = torch.zeros(layout.padded_size, dtype=full.dtype)
        if layout.real_rows:
            layout.unpadded(padded).copy_(layout.rows_of(full))
        shards.append(padded.reshape(-1))
    return torch.cat(shards)


def test_an_uneven_dim_0_gives_each_rank_torch_chunks_rows_and_pads_the_rest():
    full = torch.arange(15.0).view(5, 3)
    layouts = _layouts((5, 3), 0, 4)
    chunks = list(torch.chunk(full, 4, dim=0)) + [full[5:]]  # chunk makes 3 pieces; the last rank holds none
    assert [layout.real_rows for layout in layouts] == [2, 2, 1, 0]
    assert all(layout.rows == 2 and layout.padded_size == (2, 3) for layout in layouts)
    assert [tuple(layout.sharded_size) for layout in layouts] == [(2, 3), (2, 3), (1, 3), (0, 3)]
    for layout, chunk in zip(layouts[:3], chunks):
        assert torch.equal(layout.rows_of(full), chunk)


@pytest.mark.parametrize("size, world", [((5, 3), 4), ((8, 2), 4), ((1, 7), 2), ((3,), 4)])
def test_the_all_gathers_output_viewed_unsharded_is_the_full_tensor_bitwise(size, world):
    full = torch.randn(size)
    layouts = _layouts(size, 0, world)
    flat = _all_gather(full, layouts)
    assert flat.numel() == world * layouts[0].padded_numel
    assert torch.equal(layouts[0].unsharded_view(flat), full)
    assert torch.equal(layouts[0].rank_major_view(flat, world)[1].view(layouts[1].padded_size)[:layouts[1].real_rows],
                       layouts[1].rows_of(full))


def test_a_cut_along_dim_1_is_even_and_each_ranks_chunk_lands_where_the_full_tensor_holds_it():
    # along another dim the output buffer is laid out as the full tensor; rank r's shard (torch.chunk's piece
    # r) is written through row r of the rank-major view, a strided view into it
    full = torch.randn(3, 8, 2)
    layouts = _layouts((3, 8, 2), 1, 4)
    assert all(layout.real_rows == layout.rows == 2 for layout in layouts)
    buffer = torch.full((full.numel(),), float("nan"))
    rank_major = layouts[0].rank_major_view(buffer, 4)
    for rank, chunk in enumerate(torch.chunk(full, 4, dim=1)):
        rank_major[rank].copy_(chunk)
    assert torch.equal(layouts[0].unsharded_view(buffer), full)


def test_an_uneven_cut_along_another_dim_is_refused_in_torchs_words():
    with pytest.raises(UnsupportedParameterLayoutError, match="FSDP does not support uneven sharding on dim 1"):
        ShardLayout.of(torch.Size((4, 6)), 1, 4, 0, "layer.w")
