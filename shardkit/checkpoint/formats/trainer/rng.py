"""The per-rank RNG files of an Accelerate or Trainer checkpoint, as shardkit's ``rng.*`` state.

Accelerate's ``save_state`` writes ``random_states_<rank>.pkl`` (``random_state``,
``numpy_random_seed``, ``torch_manual_seed``, ``torch_cuda_manual_seed``), the
Trainer ``rng_state_<rank>.pth`` (``python``, ``numpy``, ``cpu``, ``cuda``):
``torch.save`` files of Python's ``random.getstate()``, numpy's legacy
``np.random.get_state()`` and torch's generator states.  Read here with torch's
allowlisting unpickler plus numpy's array pickling names, each mapped to a
bounded stand-in: ``numpy.dtype`` gives the uint32 of a Mersenne Twister key
and nothing else, ``_reconstruct`` only the empty array that the pickled bytes
then fill (numpy refuses bytes that do not match the shape), so neither code
nor memory beyond what the file holds comes from it.  The states are
re-expressed in the names :mod:`shardkit.wire.rng_keys` gives a rank's state
(``rng.world_size``, ``rng.rank<r>.python``, ``.numpy``, ``.torch``,
``.cuda.<device>``), so ``shardkit.data`` restores them: exactly at the same
world size, reseeded from them (deterministically, with a warning) at another.
A single-process Trainer's ``rng_state.pth`` is rank 0 of 1.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import torch

from shardkit.checkpoint.formats.torchsave.mapped import MappedTorchFile, tensors_in
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import InvalidManifest
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
    RNG_ROOT,
    TORCH,
    WORLD_SIZE,
    rank_key,
)

__all__ = ["RNG_FILE", "SINGLE_PROCESS_FILE", "rng_files", "read_rng_state"]

RNG_FILE = re.compile(r"^(?:random_states|rng_state)_(\d+)\.(?:pkl|pth)$")
SINGLE_PROCESS_FILE = "rng_state.pth"  # the Trainer's, when one process trained
# the keys each framework stores each generator under
_PYTHON, _NUMPY, _TORCH, _CUDA = ("random_state", "python"), ("numpy_random_seed", "numpy"), \
    ("torch_manual_seed", "cpu"), ("torch_cuda_manual_seed", "cuda")


def rng_files(names: Sequence[str], where: str = "") -> list[str]:
    """The RNG files among ``names``, in rank order; one missing rank is an error naming it."""
    if SINGLE_PROCESS_FILE in names:
        return [SINGLE_PROCESS_FILE]
    found = sorted((n for n in names if RNG_FILE.match(n)), key=lambda n: int(RNG_FILE.match(n).group(1)))
    ranks = [int(RNG_FILE.match(n).group(1)) for n in found]
    missing = sorted(set(range(max(ranks, default=-1) + 1)) - set(ranks))
    if missing:
        raise InvalidManifest(f"{where}: the RNG files of ranks {ranks} are there, rank {missing[0]}'s is missing")
    return found


class _NdarrayName:
    """What the name ``numpy.ndarray`` means in an RNG file: a marker :func:`_reconstruct` accepts, never
    something the file can call."""


def _uint32_dtype(name: Any, align: Any = False, copy: Any = True) -> Any:
    """``numpy.dtype(...)`` as an RNG file may call it: the uint32 of a Mersenne Twister key, nothing else."""
    import numpy as np

    if name != "u4":
        raise ValueError(f"numpy dtype {name!r}: an RNG state holds uint32 keys only")
    return np.dtype("u4")


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> Any:
    """``numpy.core.multiarray._reconstruct`` as pickle calls it: an empty array the BUILD that follows fills
    (``ndarray.__setstate__`` refuses data that does not match its shape, so memory is what the file holds)."""
    import numpy as np

    if cls is not _NdarrayName or tuple(shape) != (0,):
        raise ValueError("numpy arrays in an RNG file are rebuilt from their pickled bytes only")
    return np.ndarray((0,), dtype="u1")


def _numpy_globals() -> list[tuple[Callable, str]]:
    """The names numpy pickles an array under (numpy 1 and 2), mapped to the bounded stand-ins above; numpy's
    array and uint32 dtype classes themselves are listed under names no pickle uses, only so that BUILD may
    set their state."""
    try:
        import numpy as np
    except ImportError:
        return []
    names: list[tuple[Callable, str]] = [
        (_reconstruct, "numpy._core.multiarray._reconstruct"), (_reconstruct, "numpy.core.multiarray._reconstruct"),
        (_NdarrayName, "numpy.ndarray"), (_uint32_dtype, "numpy.dtype"),
        (np.ndarray, "shardkit.rng.ndarray-state"), (type(np.dtype("u4")), "shardkit.rng.uint32-dtype-state")]
    return names


def _first(state: dict, keys: tuple[str, str]) -> Any:
    return next((state[k] for k in keys if k in state), None)


def _rank_state(state: Any, where: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One rank's file as shardkit's rng state of that rank: (tensors, values), keys relative to the rank."""
    if not isinstance(state, dict):
        raise InvalidManifest(f"{where}: holds a {type(state).__name__}, not a dict of RNG states")
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    python = _first(state, _PYTHON)
    if isinstance(python, tuple) and len(python) == 3:
        version, internal, gauss = python
        values.update({f"{PYTHON}.{PYTHON_VERSION}": int(version),
                       f"{PYTHON}.{PYTHON_STATE}": [int(x) for x in internal], f"{PYTHON}.{PYTHON_GAUSS}": gauss})
    legacy = _first(state, _NUMPY)
    if isinstance(legacy, tuple) and len(legacy) == 5:
        kind, key, pos, has_gauss, cached = legacy
        try:
            tensors[f"{NUMPY}.{NUMPY_KEY}"] = torch.as_tensor(key.astype("int64"))
            values.update({f"{NUMPY}.{NUMPY_KIND}": str(kind), f"{NUMPY}.{NUMPY_POS}": int(pos),
                           f"{NUMPY}.{NUMPY_HAS_GAUSS}": int(has_gauss),
                           f"{NUMPY}.{NUMPY_CACHED_GAUSSIAN}": float(cached)})
        except (AttributeError, TypeError, ValueError) as exc:
            raise InvalidManifest(f"{where}: the numpy generator state is malformed ({exc})") from None
    cpu = _first(state, _TORCH)
    if isinstance(cpu, torch.Tensor):
        tensors[TORCH] = cpu.clone()
    cuda = _first(state, _CUDA)  # one device's state, or every device's (get_rng_state_all)
    for i, t in enumerate(cuda if isinstance(cuda, (list, tuple)) else [cuda]):
        if isinstance(t, torch.Tensor):
            tensors[f"{CUDA}.{i}"] = t.clone()
    if TORCH not in tensors or f"{PYTHON}.{PYTHON_STATE}" not in values:
        raise InvalidManifest(f"{where}: no Python and torch generator states (found {sorted(state)})")
    return tensors, values


def read_rng_state(folder: Storage, names: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every rank's RNG file, as ``rng.*`` tensors and values."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {f"{RNG_ROOT}.{WORLD_SIZE}": len(names)}
    for rank, name in enumerate(names):
        file = MappedTorchFile(folder.child(name), safe_globals=_numpy_globals(), unsafe_hint=(
            "an RNG file holds Python, numpy and torch generator states and nothing else"))
        try:
            stored = tensors_in(file.obj)
            file.map_tensors(stored)
            for t in stored:  # the generator states' records are checked before they are copied
                file.ensure_checked(t, folder.where(name))
            t, v = _rank_state(file.obj, folder.where(name))
        finally:
            file.close()
        prefix = f"{RNG_ROOT}.{rank_key(rank)}"
        tensors.update({f"{prefix}.{k}": x for k, x in t.items()})
        values.update({f"{prefix}.{k}": x for k, x in v.items()})
    return tensors, values
