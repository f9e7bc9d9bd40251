"""Writing the pickle streams other tools read, opcode by opcode, without the pickle module.

Two files shardkit writes are pickles that torch reads back: a torch.save
archive's ``data.pkl`` (dicts, numbers, strings and ``_rebuild_tensor_v2``
calls, all on ``torch.load(weights_only=True)``'s allowlist) and DCP's
``.metadata`` (a handful of dataclasses).  Both need only a few protocol-2
opcodes, and emitting them by hand keeps shardkit free of ``pickle.dump``:
what is written is exactly the data described here, never an arbitrary
object graph.

Besides JSON-like values, :func:`encode` understands four markers:
:class:`PickleTuple` (a tuple, where plain tuples and lists both become
lists), :class:`Global` (a module attribute), :class:`Call` (``f(*args)``)
and :class:`New` (an object rebuilt the way pickle rebuilds a dataclass:
``cls.__new__(cls)`` then its state), plus :class:`Persistent` for
torch.save's storage references.  ``torch.dtype`` values are written as the
``torch.<name>`` globals pickle uses for them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardkit.errors import UnsupportedFormat

__all__ = ["PickleTuple", "Global", "Call", "New", "Persistent", "encode"]


class PickleTuple(tuple):
    """Written as a tuple (plain tuples and lists are written as lists, as JSON would hold them)."""


class Persistent(tuple):
    """A persistent id (``BINPERSID``): how torch.save refers to a storage record from ``data.pkl``."""


@dataclass(frozen=True, eq=False)
class Global:
    module: str
    name: str


@dataclass(frozen=True, eq=False)
class Call:
    """``module.name(*args)``: torch.Size, layouts, enum members, tensor rebuilds."""

    module: str
    name: str
    args: tuple


@dataclass(frozen=True, eq=False)  # identity hash: New objects serve as dict keys (DCP's MetadataIndex)
class New:
    """``module.name`` rebuilt like a dataclass: NEWOBJ with no arguments, then BUILD with ``state``
    (skipped when ``None``)."""

    module: str
    name: str
    state: Any = None


def encode(root: Any, translate: Callable[[Any], Any] | None = None) -> bytes:
    """The protocol-2 pickle of ``root``; ``translate`` maps other objects to encodable ones."""
    out = bytearray(b"\x80\x02")

    def glob(module: str, name: str) -> None:
        out.extend(b"c" + f"{module}\n{name}\n".encode())

    def value(v: Any) -> None:
        if v is None:
            out.extend(b"N")
        elif v is True:
            out.extend(b"\x88")
        elif v is False:
            out.extend(b"\x89")
        elif isinstance(v, int):
            if -(2 ** 31) <= v < 2 ** 31:
                out.extend(b"J" + struct.pack("<i", v))
            else:
                raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
                out.extend(b"\x8a" + bytes([len(raw)]) + raw)
        elif isinstance(v, float):
            out.extend(b"G" + struct.pack(">d", v))
        elif isinstance(v, str):
            raw = v.encode("utf-8")
            out.extend(b"X" + struct.pack("<I", len(raw)) + raw)
        elif isinstance(v, (PickleTuple, Persistent)):
            out.extend(b"(")
            for x in v:
                value(x)
            out.extend(b"t" + (b"Q" if isinstance(v, Persistent) else b""))
        elif isinstance(v, (list, tuple)):
            out.extend(b"](")
            for x in v:
                value(x)
            out.extend(b"e")
        elif isinstance(v, dict):
            out.extend(b"}(")
            for k, x in v.items():
                value(k)
                value(x)
            out.extend(b"u")
        elif isinstance(v, Global):
            glob(v.module, v.name)
        elif isinstance(v, Call):
            glob(v.module, v.name)
            value(PickleTuple(v.args))
            out.extend(b"R")
        elif isinstance(v, New):
            glob(v.module, v.name)
            out.extend(b")\x81")
            if v.state is not None:
                value(v.state)
                out.extend(b"b")
        elif isinstance(v, torch.dtype):
            glob("torch", str(v).replace("torch.", ""))
        else:
            other = translate(v) if translate is not None else None
            if other is None:
                raise UnsupportedFormat(f"cannot write a {type(v).__name__} into a pickle stream")
            value(other)

    value(root)
    out.extend(b".")
    return bytes(out)
