"""The names a rank's RNG state is kept under: the ones files hold, and the ones data.rng captures."""

from __future__ import annotations

from shardkit.data.rng import capture_rng_state
from shardkit.wire import rng_keys as k


def test_the_names_are_the_ones_checkpoints_hold():
    assert (k.RNG_ROOT, k.WORLD_SIZE, k.rank_key(3)) == ("rng", "world_size", "rank3")
    assert (k.PYTHON, k.NUMPY, k.TORCH, k.CUDA) == ("python", "numpy", "torch", "cuda")
    assert (k.PYTHON_VERSION, k.PYTHON_STATE, k.PYTHON_GAUSS) == ("version", "state", "gauss")
    assert (k.NUMPY_KIND, k.NUMPY_KEY, k.NUMPY_POS, k.NUMPY_HAS_GAUSS, k.NUMPY_CACHED_GAUSSIAN) == \
        ("kind", "key", "pos", "has_gauss", "cached_gaussian")


def test_a_captured_state_is_keyed_by_these_names():
    import numpy  # noqa: F401 - imported, so its generator is captured too

    state = capture_rng_state()
    assert set(state) - {k.CUDA} == {k.PYTHON, k.NUMPY, k.TORCH}
    assert set(state[k.PYTHON]) == {k.PYTHON_VERSION, k.PYTHON_STATE, k.PYTHON_GAUSS}
    assert set(state[k.NUMPY]) == {k.NUMPY_KIND, k.NUMPY_KEY, k.NUMPY_POS, k.NUMPY_HAS_GAUSS,
                                   k.NUMPY_CACHED_GAUSSIAN}
