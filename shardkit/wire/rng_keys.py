"""The names a rank's RNG state is kept under, for every reader and writer of it.

:mod:`shardkit.data.rng` captures and restores the generators under these
names, :mod:`shardkit.data.resume` keeps every rank's state under
``rng.world_size`` and ``rng.rank<r>``, and the Accelerate / Trainer reader
(:mod:`shardkit.checkpoint.formats.trainer.rng`) re-expresses those
frameworks' files in the same names, so that ``shardkit.data`` restores them.
A name spelled differently in one place would be a state silently not restored.
"""

from __future__ import annotations

__all__ = ["RNG_ROOT", "WORLD_SIZE", "rank_key", "PYTHON", "NUMPY", "TORCH", "CUDA", "PYTHON_VERSION",
           "PYTHON_STATE", "PYTHON_GAUSS", "NUMPY_KIND", "NUMPY_KEY", "NUMPY_POS", "NUMPY_HAS_GAUSS",
           "NUMPY_CACHED_GAUSSIAN"]

RNG_ROOT = "rng"           # the data state's entry holding every rank's RNG state
WORLD_SIZE = "world_size"  # how many ranks saved one (beside their ``rank<r>`` entries)

# one rank's state: a generator each
PYTHON = "python"  # random.getstate(), as the three fields below
NUMPY = "numpy"    # np.random's legacy state, as the five fields below
TORCH = "torch"    # torch.get_rng_state(), a uint8 tensor
CUDA = "cuda"      # {"<device index>": torch.cuda.get_rng_state(i)}

PYTHON_VERSION, PYTHON_STATE, PYTHON_GAUSS = "version", "state", "gauss"
NUMPY_KIND, NUMPY_KEY, NUMPY_POS, NUMPY_HAS_GAUSS, NUMPY_CACHED_GAUSSIAN = \
    "kind", "key", "pos", "has_gauss", "cached_gaussian"


def rank_key(rank: int) -> str:
    """The entry of rank ``rank``'s state: ``rank<r>``."""
    return f"rank{rank}"
