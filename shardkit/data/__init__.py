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
``stateful``        ``Stateful(obj, scope=..., reshard=...)`` and ``select_state``:
                    objects saved globally or per rank
``rng``             ``capture_rng_state`` / ``restore_rng_state``: Python, numpy,
                    torch CPU and CUDA generators
``resume``          ``data_state_dict`` / ``load_data_state_dict`` / ``nest``:
                    all of it in and out of a checkpoint in one call each;
                    ``check_data_state_dict``: its refusals, restoring nothing
``encode``          lossless JSON-plus-tensors form of any ``state_dict()``
``gather``          the pickle-free all-gather behind per-rank state
==================  ==========================================================
"""

from shardkit.data.loader import ElasticLoader
from shardkit.data.resume import check_data_state_dict, data_state_dict, load_data_state_dict, nest
from shardkit.data.rng import capture_rng_state, reseeded_seeds, restore_rng_state
from shardkit.data.sampler import ElasticSampler, share_bounds
from shardkit.data.stateful import Stateful, select_state

__all__ = [
    "ElasticSampler",
    "ElasticLoader",
    "share_bounds",
    "Stateful",
    "select_state",
    "capture_rng_state",
    "restore_rng_state",
    "reseeded_seeds",
    "data_state_dict",
    "load_data_state_dict",
    "check_data_state_dict",
    "nest",
]
