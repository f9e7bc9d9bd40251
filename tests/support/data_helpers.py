"""Input-pipeline stand-ins shared by the data tests and the documentation examples.

They live here, not in a test module, so that ``tests/support/docs_given.py`` can hand the same
objects to the documentation blocks without importing a test module.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class IndexDataset(Dataset):
    """Sample ``i`` is ``i``: what a batch holds is exactly which samples it drew."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class IndexedRegression(Dataset):
    """``n`` seeded synthetic regression samples (8 features, 1 target); item ``i`` is ``(i, x, y)``, so a
    test sees which samples each batch drew as well as what it trained on.  The same seed gives the same
    bits in every process, which is what lets a resumed run be compared with an uninterrupted one."""

    def __init__(self, n: int, seed: int = 11) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.n = n
        self.x = torch.randn(n, 8, generator=gen)
        self.y = torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class ShardReader:
    """A per-rank object: counts the samples its rank has read."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.samples = state["samples"]
