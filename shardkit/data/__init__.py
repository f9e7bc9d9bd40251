"""Resumable input state: where the data stands, stateful objects, and RNG.

A resumed run is the same run only if the data position and the random
streams come with the weights.  This package captures them as plain JSON
values and CPU tensors (never pickle) that a checkpoint stores next to the
model, and restores them at the same world size exactly and at another one by
documented rules (docs/checkpoint.md, "Data position and RNG").

==================  ==========================================================
``sampler``         ``ElasticSampler``: a global batch sequence independent of
                    the world size, cut into contiguous per-rank shares; its
                    position is global (epoch, global batches consumed)
``loader``          ``ElasticLoader``: a ``DataLoader`` that reports what the
                    loop received, so prefetching workers cannot skew the position
``rng``             ``capture_rng_state`` / ``restore_rng_state``: Python, numpy,
                    torch CPU and CUDA generators
==================  ==========================================================
"""

from shardkit.data.loader import ElasticLoader
from shardkit.data.rng import capture_rng_state, reseeded_seeds, restore_rng_state
from shardkit.data.sampler import ElasticSampler, share_bounds

__all__ = [
    "ElasticSampler",
    "ElasticLoader",
    "share_bounds",
    "capture_rng_state",
    "restore_rng_state",
    "reseeded_seeds",
]
