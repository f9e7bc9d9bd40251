"""How a plain value is spelled in JSON: the scalars as they are, a non-finite float as a tagged object.

JSON cannot spell ``nan``, ``inf`` or ``-inf``, and both the checkpoint's
values (:mod:`shardkit.checkpoint.state.tree`) and an object's input state
(:mod:`shardkit.data.encode`) hold them (a scheduler's ``best=inf``).  Both
write ``{"$float": "nan" | "inf" | "-inf"}``, so a file any of them wrote
reads the same everywhere; containers are theirs to spell.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FLOAT_TAG", "NON_FINITE", "is_json_scalar", "encode_scalar", "is_tagged_float"]

FLOAT_TAG = "$float"
NON_FINITE = ("nan", "inf", "-inf")


def is_json_scalar(value: Any) -> bool:
    """Whether ``value`` is one of the scalars :func:`encode_scalar` spells (``None``, bool, int, float, str)."""
    return value is None or isinstance(value, (bool, str, int, float))


def encode_scalar(value: Any) -> Any:
    """``value`` (a :func:`is_json_scalar`) as JSON: ints and floats as the built-in types (a numpy float
    becomes a ``float``), a non-finite float as ``{"$float": "nan" | "inf" | "-inf"}``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if math.isfinite(value):
        return float(value)
    return {FLOAT_TAG: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def is_tagged_float(value: Any) -> bool:
    """Whether ``value`` is a non-finite float as :func:`encode_scalar` spells it (``float(value["$float"])``
    is then the float)."""
    return isinstance(value, dict) and set(value) == {FLOAT_TAG} and value[FLOAT_TAG] in NON_FINITE
