"""A DCP checkpoint's non-tensor values, decoded one key at a time (:meth:`.reader.DcpReader.values`).

DCP stores every non-tensor value as its own ``torch.save`` payload, so one
value shardkit cannot read must not stop it from reading the others.  Some
writers store values no checkpoint can carry without running pickle:
torchtitan's ``ParallelAwareDataloader`` saves ``dataloader.dp_rank_<r>`` as
``pickle.dumps`` bytes, so every torchtitan step holds one per rank.  Those
bytes are decoded (the outer payload through ``torch.load(weights_only=True)``,
its CRC-32s checked) but never unpickled: shardkit does not run a pickle.

So :class:`DcpValues` lists every key and decodes a value only when asked:

* ``values[key]`` (a load asking for that key) decodes it, or raises
  :class:`~shardkit.errors.UnsupportedFormat` naming the key and the file when
  it is such a pickle;
* iterating ``items()``/``values()`` (a conversion copying them all) yields
  the readable ones and leaves the others out with one WARNING naming them;
* :meth:`DcpValues.unreadable` says which keys are left out and why
  (``inspect``).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, ItemsView, Iterator, Mapping, Sequence, ValuesView

from shardkit.errors import ConfigurationError, ShardkitError, UnsafeCheckpoint, UnsupportedFormat

__all__ = ["DcpValues", "value_groups"]

log = logging.getLogger(__name__)

_GROUP = re.compile(r"^(.*param_groups)\.(\d+)\.([^.]+)$")

# decode(stored key) -> the decoded object (its payload's CRC-32s checked, torch.load's allowlist applied)
Decode = Callable[[str], Any]
# to_json(object, key) -> JSON value, or ConfigurationError when it is no JSON type
ToJson = Callable[[Any, str], Any]


def value_groups(stored: Sequence[str], ours: Mapping[str, str]) -> dict[str, list[str]]:
    """Our key -> the stored keys that make its value: DCP flattens ``optim.param_groups`` into
    ``optim.param_groups.<i>.<key>``, which read back as one list; every other value is one key."""
    out: dict[str, list[str]] = {}
    for key in stored:
        name = ours[key]
        m = _GROUP.match(name)
        out.setdefault(m.group(1) if m else name, []).append(key)
    return out


def _unreadable(obj: Any) -> str:
    """Why a decoded value that is no JSON type cannot be carried (said the same way in every message)."""
    if isinstance(obj, (bytes, bytearray)):
        if obj[:1] == b"\x80":
            return "pickled bytes (a pickle shardkit does not run)"
        return f"{len(obj)} raw bytes (shardkit stores JSON values only)"
    kind = type(obj).__name__
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind} (shardkit stores JSON values only)"


class DcpValues(Mapping[str, Any]):
    """Every non-tensor value of a DCP checkpoint, decoded when first asked for (see the module docstring)."""

    def __init__(self, groups: Mapping[str, Sequence[str]], ours: Mapping[str, str], decode: Decode,
                 to_json: ToJson, where: Callable[[str], str], url: str) -> None:
        self._groups = dict(groups)
        self._where = where  # stored key -> "file [key]"
        self._url = url
        self._ours = ours
        self._decode = decode
        self._to_json = to_json
        self._done: dict[str, Any] = {}
        self._refused: dict[str, tuple[str, str]] = {}  # key -> (where, why)
        self._warned = False

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __contains__(self, key: object) -> bool:
        return key in self._groups

    def __getitem__(self, key: str) -> Any:
        if key not in self._groups:
            raise KeyError(key)
        if self._readable(key):
            return self._done[key]
        where, why = self._refused[key]
        raise UnsupportedFormat(f"{where}: value {key!r} is {why}; shardkit does not unpickle it, so it cannot be "
                                "loaded or converted: leave it out of the state to load (or --exclude it)")

    def _readable(self, key: str) -> bool:
        """Decode ``key`` once; whether it is a JSON value (else ``_refused`` says where and why)."""
        if key in self._done:
            return True
        if key in self._refused:
            return False
        parts: dict[str, Any] = {}
        for stored in self._groups[key]:
            try:
                obj = self._decode(stored)
            except UnsafeCheckpoint as exc:  # a class outside torch.load's allowlist: never constructed
                where = self._where(stored)
                self._refused[key] = (where, f"a pickle shardkit does not run ({str(exc).removeprefix(where + ': ')})")
                return False
            try:
                parts[self._ours[stored]] = self._to_json(obj, self._ours[stored])
            except ConfigurationError:
                self._refused[key] = (self._where(stored), _unreadable(obj))
                return False
        if len(parts) == 1 and key in parts:
            self._done[key] = parts[key]
        else:  # a flattened param_groups list
            by_index: dict[int, dict[str, Any]] = {}
            for name, value in parts.items():
                m = _GROUP.match(name)
                if m is None:
                    raise ShardkitError(f"{key!r}: stored key {name!r} is not part of it")
                by_index.setdefault(int(m.group(2)), {})[m.group(3)] = value
            self._done[key] = [by_index[i] for i in sorted(by_index)]
        return True

    def refusal(self, key: str) -> str | None:
        """Why value ``key`` is left out (``None``: it reads).  Raises what a damaged payload raises."""
        return None if self._readable(key) else self._refused[key][1]

    def unreadable(self) -> dict[str, str]:
        """Key -> why, for every value shardkit leaves out because reading it would mean running a pickle
        (or it is no JSON type): decodes every value."""
        return {key: self._refused[key][1] for key in self._groups if not self._readable(key)}

    def readable_items(self) -> Iterator[tuple[str, Any]]:
        """(key, value) of every readable value; once, a WARNING naming those left out."""
        left_out = []
        for key in self._groups:
            if self._readable(key):
                yield key, self._done[key]
            else:
                left_out.append(key)
        if left_out and not self._warned:
            self._warned = True
            log.warning("left out %d value(s) of %s that shardkit cannot read without running pickle: %s",
                        len(left_out), self._url,
                        "; ".join(f"{k} ({self._refused[k][1]})" for k in left_out))

    def items(self) -> ItemsView[str, Any]:
        """The readable values (a conversion's copy of them all); the others are left out, with one WARNING."""
        return _Items(self)

    def values(self) -> ValuesView[Any]:
        return _Values(self)


class _Items(ItemsView):
    """The readable items of a :class:`DcpValues` (``ItemsView`` would ask for every key)."""

    def __init__(self, owner: DcpValues) -> None:
        super().__init__(owner)
        self.owner = owner

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self.owner.readable_items()


class _Values(ValuesView):
    def __init__(self, owner: DcpValues) -> None:
        super().__init__(owner)
        self.owner = owner

    def __iter__(self) -> Iterator[Any]:
        return (value for _, value in self.owner.readable_items())
