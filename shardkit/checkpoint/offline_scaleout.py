"""Scale-out of ``reshard`` across ranks under torchrun: split output work units by bytes.

One process is the default.  Under ``torchrun ... -m shardkit reshard ...``
(``WORLD_SIZE`` > 1 in the environment) every rank plans the same output
layout, takes the data files assigned to it (greedy by bytes, largest first,
so ranks finish together), writes them, and rank 0 commits the manifest
after a barrier.  Nothing but the plan's assignment and one barrier travels
over torch.distributed.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["run_reshard", "scaleout_rank"]


def scaleout_rank() -> tuple[int, int]:
    """(rank, world size) of a torchrun launch, or (0, 1) for a plain process."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def run_reshard(src: str, dst: str, **kwargs: Any) -> Any:
    from shardkit.checkpoint.convert import reshard

    return reshard(src, dst, **kwargs)
