"""Where one parameter's rows go when ``fully_shard`` cuts it: which parameters
can be cut (refused in torch's words otherwise) and the arithmetic of the cut.

This is pure size arithmetic, decided once per parameter from its shape, the
shard dim and the mesh; :class:`~shardkit.runtime.sharded_param.ShardedParam`
owns the tensors that live in these shapes and their life across iterations.
Kept apart so that the rule "every rank sends the same number of elements"
reads in one place, without the storage juggling around it.

Note [the padded cut]
    Along ``shard_dim`` of size ``S`` over ``W`` ranks, each rank owns
    ``rows = ceil(S / W)`` rows starting at ``rank * rows``; the last ranks
    own fewer (``real_rows``) or none.  Every rank still holds ``rows`` rows
    (``padded_size``), zero past its real ones, so the all-gather output is
    ``W * padded_numel`` elements, rank-major: the full tensor is its first
    ``numel`` elements when ``shard_dim`` is 0.  Any other shard dim must
    divide evenly (torch's rule), so no padding arises there and the output
    is the full tensor with the rank as its outermost dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from shardkit.errors import InvalidShardDimError, UnshardableParameterError, UnsupportedParameterLayoutError

__all__ = ["ShardLayout", "check_shardable"]


def check_shardable(param: nn.Parameter, data: torch.Tensor, shard_dim: int, name: str, fqn: str) -> int:
    """The shard dim of ``data`` (the parameter's own or TP-local tensor) made non-negative, once it is
    known the tensor can be cut there at all.  Each check raises torch's builtin with torch's wording
    first (see shardkit.errors); ``name`` is the parameter's name on its module, ``fqn`` the full one."""
    if data.dim() == 0:
        raise UnshardableParameterError(
            "fully_shard doesn't support scalar parameters. "
            f"Change {name} to a 1D tensor with numel equal to 1. Parameter {fqn}: e.g. "
            "nn.Parameter(torch.tensor([x])), or pass it in ignored_params"
        )
    if not data.is_contiguous():
        raise UnsupportedParameterLayoutError(
            f"FSDP does not support non-contiguous parameters yet: {param.shape=} {param.stride()=}. "
            f"Make parameter {fqn} contiguous before fully_shard (e.g. nn.Parameter(w.contiguous()))"
        )
    asked = shard_dim
    if shard_dim < 0:
        shard_dim += data.dim()
    if not 0 <= shard_dim < data.dim():
        raise InvalidShardDimError(
            f"Shard dim {shard_dim if shard_dim >= 0 else asked} is invalid for {data.dim()}D tensor: "
            f"{param.shape}. shard_placement_fn returned Shard({asked}) for parameter {fqn}; "
            f"return Shard(d) with -{data.dim()} <= d < {data.dim()}, or None for Shard(0)"
        )
    return shard_dim


@dataclass(frozen=True)
class ShardLayout:
    """One rank's cut of one tensor (Note [the padded cut])."""

    shard_dim: int
    orig_size: torch.Size     # the tensor FSDP gathers: TP-local for a TP parameter
    rank: int
    rows: int                 # rows per rank along shard_dim, padding included
    real_rows: int            # this rank's rows that hold data
    padded_size: torch.Size   # this rank's shard with its padding
    sharded_size: torch.Size  # this rank's shard without it

    @classmethod
    def of(cls, size: torch.Size, shard_dim: int, world: int, rank: int, fqn: str) -> ShardLayout:
        """Rank ``rank`` of ``world``'s cut of a tensor of ``size``; only dim 0 may be uneven (torch's rule
        and wording)."""
        if shard_dim != 0 and size[shard_dim] % world != 0:
            raise UnsupportedParameterLayoutError(
                f"FSDP does not support uneven sharding on dim {shard_dim}: {size} (world size: {world}). "
                f"Parameter {fqn}: {size[shard_dim]} is not divisible by {world}; only dim 0 may be "
                "uneven, so return Shard(0) (or None) from shard_placement_fn for it"
            )
        rows = math.ceil(size[shard_dim] / world)
        real_rows = max(0, min(rows, size[shard_dim] - rank * rows))
        padded_size, sharded_size = list(size), list(size)
        padded_size[shard_dim], sharded_size[shard_dim] = rows, real_rows
        return cls(shard_dim, size, rank, rows, real_rows, torch.Size(padded_size), torch.Size(sharded_size))

    @property
    def numel(self) -> int:
        return self.orig_size.numel()

    @property
    def padded_numel(self) -> int:
        return self.padded_size.numel()

    def rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's real rows of the full tensor (call only when ``real_rows > 0``)."""
        return full.narrow(self.shard_dim, self.rank * self.rows, self.real_rows)

    def unpadded(self, padded: torch.Tensor) -> torch.Tensor:
        """The view of a ``padded_size`` tensor that holds data: the shard the DTensor shows."""
        return padded.narrow(self.shard_dim, 0, self.real_rows)

    def unsharded_view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The full tensor, as a view of the flat all-gather output."""
        if self.shard_dim == 0:
            return buffer.narrow(0, 0, self.numel).view(self.orig_size)
        return buffer.view(self.orig_size)

    def rank_major_view(self, buffer: torch.Tensor, world: int) -> torch.Tensor:
        """A ``(world, ...)`` view of the flat all-gather output whose row ``r`` is rank ``r``'s shard
        (a strided view when ``shard_dim`` is not 0)."""
        if self.shard_dim == 0:
            return buffer.view(world, -1)
        d, size = self.shard_dim, list(self.orig_size)
        split = size[:d] + [world, size[d] // world] + size[d + 1:]
        return buffer.view(split).movedim(d, 0)
