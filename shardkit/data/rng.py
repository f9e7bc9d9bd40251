"""Every rank's RNG state as JSON and tensors, restored exactly at the same world size.

Why: dropout masks and random augmentations are drawn from process-global
generators.  A resumed run that restores weights and data position but starts
its RNGs from the seed draws different masks from the uninterrupted run, so
the two runs diverge after the first step.  Restoring the generators makes the
resumed run bit-identical.

What one rank's state holds (``capture_rng_state``), all without pickle, under the names of
:mod:`shardkit.wire.rng_keys`:

* ``python``: ``random.getstate()`` as ``{"version": int, "state": [625 ints], "gauss": float | None}``;
* ``numpy`` (only when numpy is imported): the legacy ``np.random`` state as
  ``{"kind": "MT19937", "key": int64 tensor [624], "pos": int, "has_gauss": int, "cached_gaussian": float}``;
* ``torch``: ``torch.get_rng_state()``, a ``uint8`` tensor;
* ``cuda`` (only when CUDA is initialised): ``{"<device index>": uint8 tensor}``.

At another world size there is no exact continuation: the old ranks' streams
were tied to the old ranks' shares of each batch.  The rule instead: new rank
``r`` takes the saved state of old rank ``r % old_world_size`` and hashes it
(SHA-256 over every generator's state) together with ``r`` into fresh seeds
for ``random``, ``np.random`` and ``torch.manual_seed`` (CPU and every CUDA
device).  Streams are thus deterministic for a given checkpoint and new rank,
distinct across ranks, and distinct from a fresh run's.  A warning on
``shardkit.data.rng`` says so.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import random
import sys
from typing import Any

import torch

from shardkit.errors import DataStateError
from shardkit.wire.rng_keys import (
    CUDA,
    NUMPY,
    NUMPY_CACHED_GAUSSIAN,
    NUMPY_HAS_GAUSS,
    NUMPY_KEY,
    NUMPY_KIND,
    NUMPY_POS,
    PYTHON,
    PYTHON_GAUSS,
    PYTHON_STATE,
    PYTHON_VERSION,
    TORCH,
)

__all__ = ["capture_rng_state", "restore_rng_state", "check_rng_state", "reseeded_seeds"]

log = logging.getLogger("shardkit.data.rng")

_RESEED_TAG = b"shardkit.data.rng/reseed/v1"


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG state: JSON values and tensors (copies), see the module docstring."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        PYTHON: {PYTHON_VERSION: int(version), PYTHON_STATE: [int(x) for x in internal], PYTHON_GAUSS: gauss},
        TORCH: torch.get_rng_state().clone(),
    }
    np = sys.modules.get("numpy")
    if np is not None:
        kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state[NUMPY] = {NUMPY_KIND: str(kind), NUMPY_KEY: torch.from_numpy(key.astype(np.int64)), NUMPY_POS: int(pos),
                        NUMPY_HAS_GAUSS: int(has_gauss), NUMPY_CACHED_GAUSSIAN: float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[CUDA] = {str(i): torch.cuda.get_rng_state(i).clone() for i in range(torch.cuda.device_count())}
    return state


def restore_rng_state(states_by_old_rank: list[dict[str, Any]], rank: int, world_size: int) -> None:
    """Restore this rank's generators from the states every old rank saved.

    Same world size (``len(states_by_old_rank) == world_size``): rank ``r``
    gets old rank ``r``'s state exactly.  Otherwise the documented re-seed rule
    (module docstring) applies and a warning is logged.  Raises
    :class:`DataStateError` for a malformed state or a rank outside the world.
    """
    state = check_rng_state(states_by_old_rank, rank, world_size)
    old_world, source = len(states_by_old_rank), rank % len(states_by_old_rank)
    if old_world == world_size:
        _set_exact(state, source)
        return
    log.warning(
        "RNG state was saved by %d ranks and is restored on %d: per-rank random streams (dropout, augmentation) "
        "cannot continue exactly at another world size; rank %d re-seeds random, numpy and torch from saved "
        "rank %d's state salted with its rank (deterministic, distinct per rank)",
        old_world, world_size, rank, source)
    seeds = reseeded_seeds(state, rank)
    random.seed(seeds[PYTHON])
    torch.manual_seed(seeds[TORCH])
    if NUMPY in state or "numpy" in sys.modules:
        np = _numpy()
        if np is not None:
            np.random.seed(seeds[NUMPY])


def reseeded_seeds(state: dict[str, Any], rank: int) -> dict[str, int]:
    """The seeds rank ``rank`` uses when restoring ``state`` at another world size.

    ``python``: 64 bits, ``torch``: 63 bits (any ``torch.manual_seed`` takes
    it), ``numpy``: 32 bits (what ``np.random.seed`` takes).  Public so the
    rule can be checked and reimplemented: ``digest = sha256(TAG ||
    canonical(state) || rank as 8 bytes little-endian)``, then each seed is the
    first 8 bytes (little-endian) of ``sha256(digest || name)``.
    """
    base = hashlib.sha256(_RESEED_TAG)
    for part in _canonical_parts(state):
        base.update(len(part).to_bytes(8, "little"))
        base.update(part)
    base.update(int(rank).to_bytes(8, "little"))
    digest = base.digest()

    def derive(name: str) -> int:
        return int.from_bytes(hashlib.sha256(digest + name.encode()).digest()[:8], "little")

    return {PYTHON: derive(PYTHON), TORCH: derive(TORCH) >> 1, NUMPY: derive(NUMPY) & 0xFFFFFFFF}


def _canonical_parts(state: dict[str, Any]) -> list[bytes]:
    """Every generator's state as bytes, in a fixed order (the input of the re-seed hash)."""
    python = state[PYTHON]
    parts = [PYTHON.encode(), repr((python[PYTHON_VERSION], list(python[PYTHON_STATE]), python[PYTHON_GAUSS])).encode(),
             TORCH.encode(), bytes(state[TORCH].contiguous().clone().untyped_storage())]
    if NUMPY in state:
        np_state = state[NUMPY]
        parts += [NUMPY.encode(), repr((np_state[NUMPY_KIND], np_state[NUMPY_KEY].tolist(), np_state[NUMPY_POS],
                                        np_state[NUMPY_HAS_GAUSS], np_state[NUMPY_CACHED_GAUSSIAN])).encode()]
    for index in sorted(state.get(CUDA, {}), key=int):
        parts += [f"{CUDA}:{index}".encode(), bytes(state[CUDA][index].contiguous().clone().untyped_storage())]
    return parts


def check_rng_state(states_by_old_rank: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """The saved state ``rank`` restores from (:func:`restore_rng_state`'s rule), or the
    :class:`DataStateError` restoring it would raise; restores nothing."""
    old_world = len(states_by_old_rank)
    if old_world == 0:
        raise DataStateError("restore_rng_state: no saved RNG states (the checkpoint holds none)")
    if not 0 <= rank < world_size:
        raise DataStateError(f"restore_rng_state: rank {rank} is outside world size {world_size}")
    state = states_by_old_rank[rank % old_world]
    _check(state, rank % old_world)
    return state


def _check(state: Any, rank: int) -> None:
    where = f"saved RNG state of rank {rank}"
    if not isinstance(state, dict):
        raise DataStateError(f"{where} is a {type(state).__name__}, not a dict")
    for key in (PYTHON, TORCH):
        if key not in state:
            raise DataStateError(f"{where} lacks {key!r}; it was not written by capture_rng_state()")
    python = state[PYTHON]
    if not (isinstance(python, dict) and {PYTHON_VERSION, PYTHON_STATE, PYTHON_GAUSS} <= set(python)):
        raise DataStateError(f"{where}: 'python' must hold version, state and gauss")
    if not (isinstance(state[TORCH], torch.Tensor) and state[TORCH].dtype == torch.uint8):
        raise DataStateError(f"{where}: 'torch' must be a uint8 tensor (torch.get_rng_state())")


def _numpy() -> Any:
    try:
        return importlib.import_module("numpy")
    except ImportError:
        log.warning("the checkpoint holds numpy RNG state but numpy is not installed; np.random is not restored")
        return None


def _set_exact(state: dict[str, Any], rank: int) -> None:
    python = state[PYTHON]
    gauss = python[PYTHON_GAUSS]
    random.setstate((int(python[PYTHON_VERSION]), tuple(int(x) for x in python[PYTHON_STATE]),
                     None if gauss is None else float(gauss)))
    torch.set_rng_state(state[TORCH].to("cpu", torch.uint8).contiguous())
    if NUMPY in state:
        np = _numpy()
        if np is not None:
            s = state[NUMPY]
            np.random.set_state((s[NUMPY_KIND], s[NUMPY_KEY].numpy().astype(np.uint32), int(s[NUMPY_POS]),
                                 int(s[NUMPY_HAS_GAUSS]), float(s[NUMPY_CACHED_GAUSSIAN])))
    cuda = state.get(CUDA, {})
    if not cuda:
        return
    if not torch.cuda.is_available():
        log.warning("rank %d saved CUDA RNG states for %d devices but CUDA is not available here; they are not "
                    "restored", rank, len(cuda))
        return
    count = torch.cuda.device_count()
    if count != len(cuda):
        log.warning("rank %d saved CUDA RNG states for %d devices and %d are visible here; restoring devices "
                    "0..%d only", rank, len(cuda), count, min(count, len(cuda)) - 1)
    for index, tensor in cuda.items():
        if int(index) < count:
            torch.cuda.set_rng_state(tensor.to("cpu", torch.uint8).contiguous(), int(index))
