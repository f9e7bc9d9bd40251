"""Input-pipeline stand-ins shared by the data tests and the documentation examples.

They live here, not in a test module, so that ``tests/support/docs_given.py`` can hand the same
objects to the documentation blocks without importing a test module.
"""

from __future__ import annotations

from torch.utils.data import Dataset


class IndexDataset(Dataset):
    """Sample ``i`` is ``i``: what a batch holds is exactly which samples it drew."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class ShardReader:
    """A per-rank object: counts the samples its rank has read."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.samples = state["samples"]
