"""The checks every field of a manifest or index file goes through: one clear error naming where.

A manifest is input like any other: bounded, UTF-8 JSON whose every number,
list and object is checked for type and range before anything is planned
from it.
"""

from __future__ import annotations

import json
from typing import Any

from shardkit.errors import InvalidManifest

__all__ = ["MAX_MANIFEST_BYTES", "MAX_DIM", "MAX_NDIM", "int_field", "ints_field", "list_field", "expect_object",
           "json_object"]

MAX_MANIFEST_BYTES = 1 << 30
MAX_DIM = 1 << 48
MAX_NDIM = 64


def int_field(value: Any, where: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidManifest(f"{where} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def ints_field(value: Any, where: str, ndim: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM or (ndim is not None and len(value) != ndim):
        raise InvalidManifest(f"{where} must be a list of {ndim if ndim is not None else 'at most 64'} integers, "
                              f"got {value!r:.200}")
    return tuple(int_field(v, where, 0, MAX_DIM) for v in value)


def list_field(value: Any, where: str, length: int | None = None) -> list:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise InvalidManifest(f"{where} must be a list{f' of {length}' if length else ''}, got {value!r:.200}")
    return value


def expect_object(value: Any, where: str) -> dict:
    """``value`` if it is a JSON object, else one clear error naming ``where``."""
    if not isinstance(value, dict):
        raise InvalidManifest(f"{where} must be a JSON object")
    return value


def json_object(data: bytes, where: str) -> dict:
    """``data`` (a manifest or index file read from ``where``) as a JSON object: bounded, UTF-8, valid."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidManifest(f"{where} is {len(data)} bytes, larger than the {MAX_MANIFEST_BYTES} allowed")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidManifest(f"{where} is not valid JSON ({exc}); the checkpoint is damaged") from None
    return expect_object(doc, where)
