"""Which tensors go to the output, under which names and dtypes.

``--only``/``--exclude`` globs, ``--rename REGEX=REPL``, ``--model-only`` and
``--dtype`` are applied here once, before any byte moves, so every writer sees
the same plain list of ``(name, dtype, shape)`` and a map back to the source
names.  Errors (a rename that makes two tensors collide, a filter that keeps
nothing, a dtype that is not a float) are raised before DST is touched.

Blockwise-scaled FP8 weights (as DeepSeek-V3 ships them: ``X.weight`` in
float8 with ``X.weight_scale_inv`` in float32, one scale per 128x128 block)
are dequantized by ``--dtype``: the output ``X.weight`` is ``weight *
scale_inv`` of its block, in the asked dtype, and ``X.weight_scale_inv`` is
not written (the :class:`~shardkit.checkpoint.offline.fetch.Fetcher` does the
arithmetic box by box).

Tied keys (a source's aliases) stay tied under their output names when both
keys are kept in the same dtype; an alias whose key is filtered out, or cast
differently, becomes a tensor of its own (read from the stored one).
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import TensorEntry
from shardkit.checkpoint.formats.dtypes import itemsize
from shardkit.errors import ConfigurationError

__all__ = ["Selection", "OutputTensor", "select", "parse_dtype", "parse_rename", "SCALE_SUFFIX", "SCALE_BLOCK"]

SCALE_SUFFIX = "_scale_inv"  # X.weight_scale_inv scales X.weight, block by block
SCALE_BLOCK = 128

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
           "fp64": torch.float64, "float64": torch.float64}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``--dtype`` spelling (``bf16``, ``float32``...) → a floating torch dtype."""
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ConfigurationError(f"--dtype {name!r} is not supported; use one of bf16, fp16, fp32, fp64") from None


def parse_rename(rules: Sequence[str] | None) -> list[tuple[re.Pattern[str], str]]:
    """``--rename REGEX=REPL`` rules → compiled patterns, applied in order to every key."""
    out = []
    for rule in rules or ():
        if "=" not in rule:
            raise ConfigurationError(f"--rename {rule!r}: write REGEX=REPLACEMENT, e.g. '^model\\.=model.backbone.'")
        pattern, repl = rule.split("=", 1)
        try:
            out.append((re.compile(pattern), repl))
        except re.error as exc:
            raise ConfigurationError(f"--rename {rule!r}: bad regular expression ({exc})") from None
    return out


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the output: its output name, the source key it comes from, dtype and shape."""

    name: str
    source: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    scale_inv: str | None = None  # source key of the blockwise scales this FP8 weight is dequantized with


@dataclass
class Selection:
    """What a conversion writes: tensors in source order, JSON values, and the keys filters dropped.

    Computed once before DST is touched, so every error it can raise comes first.
    """

    tensors: list[OutputTensor]
    values: dict[str, Any]
    dropped: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # output name -> the output name it is tied to

    @property
    def rename_back(self) -> dict[str, str]:
        return {t.name: t.source for t in self.tensors if t.name != t.source}

    @property
    def dtype_for(self) -> dict[str, torch.dtype]:
        return {t.name: t.dtype for t in self.tensors}

    @property
    def scales(self) -> dict[str, str]:
        """Output name -> source key of its blockwise scales, for the weights ``--dtype`` dequantizes."""
        return {t.name: t.scale_inv for t in self.tensors if t.scale_inv}

    @property
    def triples(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(t.name, t.dtype, t.shape) for t in self.tensors]

    @property
    def nbytes(self) -> int:
        """Bytes of every output tensor (after the dtype cast): the progress total."""
        return sum(math.prod(t.shape) * itemsize(t.dtype) for t in self.tensors)

    @property
    def stored(self) -> list[OutputTensor]:
        """The tensors a format that records aliases writes: all but the aliases."""
        return [t for t in self.tensors if t.name not in self.aliases]


def _is_model(name: str) -> bool:
    return name.startswith("model.")


def select(entries: dict[str, TensorEntry], values: dict[str, Any], *, only: Sequence[str] | None = None,
           exclude: Sequence[str] | None = None, rename: Sequence[str] | None = None, model_only: bool = False,
           dtype: str | torch.dtype | None = None, dtype_optim: bool = False,
           aliases: Mapping[str, str] | None = None) -> Selection:
    """Apply filters, renames and dtype to a source's tensors and values (and its ``aliases``)."""
    rules = parse_rename(rename)
    want_dtype = parse_dtype(dtype)
    out: list[OutputTensor] = []
    kept_values: dict[str, Any] = {}
    dropped: list[str] = []
    seen: dict[str, str] = {}

    def keep(name: str) -> bool:
        if model_only and not _is_model(name):
            return False
        if only and not any(fnmatch.fnmatchcase(name, g) for g in only):
            return False
        if exclude and any(fnmatch.fnmatchcase(name, g) for g in exclude):
            return False
        return True

    def renamed(name: str) -> str:
        for pattern, repl in rules:
            name = pattern.sub(repl, name)
        return name

    scales = _blockwise_scales(entries) if want_dtype is not None else {}
    for name, entry in entries.items():
        if not keep(name) or name in scales.values():
            dropped.append(name)
            continue
        new = renamed(name)
        if new in seen:
            raise ConfigurationError(f"--rename maps both {seen[new]!r} and {name!r} to {new!r}; adjust the rule")
        seen[new] = name
        dt = entry.dtype
        if want_dtype is not None and entry.dtype.is_floating_point and (_is_model(name) or dtype_optim):
            dt = want_dtype
        out.append(OutputTensor(new, name, dt, entry.shape, scales.get(name) if dt == want_dtype else None))
    for name, value in values.items():
        if keep(name):
            kept_values[renamed(name)] = value
        else:
            dropped.append(name)
    if not out and entries:
        raise ConfigurationError("the filters (--only/--exclude/--model-only) keep no tensor; nothing to write")
    by_source = {t.source: t for t in out}
    tied = {}
    for alias, target in (aliases or {}).items():
        a, t = by_source.get(alias), by_source.get(target)
        if a is not None and t is not None and a.dtype == t.dtype:
            tied[a.name] = t.name
    return Selection(out, kept_values, dropped, tied)


def _blockwise_scales(entries: Mapping[str, TensorEntry]) -> dict[str, str]:
    """FP8 weight key -> its ``_scale_inv`` key, for every float8 matrix stored with one float scale per
    128x128 block; a scale of any other shape is refused, naming both keys."""
    found = {}
    for name, entry in entries.items():
        scale = entries.get(name + SCALE_SUFFIX)
        if scale is None or entry.dtype.itemsize != 1 or not entry.dtype.is_floating_point:
            continue
        want = tuple(-(-n // SCALE_BLOCK) for n in entry.shape)
        if len(entry.shape) != 2 or tuple(scale.shape) != want or not scale.dtype.is_floating_point:
            raise ConfigurationError(f"{name + SCALE_SUFFIX!r} is {scale.dtype} {list(scale.shape)}; dequantizing "
                                     f"{name!r} {list(entry.shape)} needs one float scale per {SCALE_BLOCK}x"
                                     f"{SCALE_BLOCK} block, {list(want)}")
        found[name] = name + SCALE_SUFFIX
    return found
