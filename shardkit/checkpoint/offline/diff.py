"""Compare two checkpoints tensor by tensor, across any formats and layouts.

Both sides are read through the same box fetcher the converters use, a block
of rows at a time, so two checkpoints larger than memory compare in bounded
memory whatever their sharding.  With ``atol = rtol = 0`` equality is bitwise
(NaNs with the same bits are equal, ``-0.0`` differs from ``0.0``); otherwise a
tensor is within tolerance when ``|a - b| <= atol + rtol * |b|`` everywhere,
as in ``torch.allclose``.  Non-tensor values are compared decoded
(:func:`~shardkit.checkpoint.state.tree.from_json_value`): a native ``{"$float": "inf"}``
equals a torch.save ``inf``, and NaN equals NaN.

A diff that compares nothing is no verdict: filters that keep no key are
refused, as ``reshard``/``convert`` refuse them.  When one side holds only the
model (an HF export) and the other a training checkpoint, and no filter was
given, only ``model.*`` is compared and the report's ``scope`` says so.

A key tied to the same key on both sides (an alias in both manifests) holds
the same bytes as that key, so it takes that key's verdict without a second
read; tied on one side only, it is compared like any tensor.

A key one side holds and the other does not is ``only-a``/``only-b`` -- unless
both sides say it is tied: the side holding it records the tie
(:meth:`~shardkit.checkpoint.formats.base.CheckpointReader.aliases`: a native
manifest's ``aliases``, a DeepSpeed checkpoint's shared parameters) to a key
the other side holds, and the side lacking it says that whoever loads it fills
the key from its partner
(:meth:`~shardkit.checkpoint.formats.base.CheckpointReader.declares_tied`: a
Hugging Face folder whose ``config.json`` ties word embeddings lacks
``lm_head.weight``, as ``save_pretrained`` writes it).  Then the other side
stores the one tensor once, under that key, and the key is compared against
it: equal only when those bytes are.  A key the lacking side does not say is
tied (an HF folder whose config unties the head, a native checkpoint the key
was filtered out of) stays ``only-a``/``only-b``, whatever its values: a
loader of that side would not fill it.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from shardkit.checkpoint.formats import open_reader
from shardkit.checkpoint.geometry.rows import iter_row_blocks, rows_per_block
from shardkit.checkpoint.offline.fetch import Fetcher
from shardkit.checkpoint.offline.options import parse_memory
from shardkit.checkpoint.offline.progress import Progress
from shardkit.checkpoint.state.aliases import alias_groups
from shardkit.checkpoint.state.tree import from_json_value
from shardkit.errors import ConfigurationError

__all__ = ["DiffReport", "TensorDiff", "diff", "same_value"]


@dataclass
class TensorDiff:
    """How one key compares: its status, the largest absolute and relative differences, and why."""

    name: str
    status: str                 # "equal", "close", "different", "only-a", "only-b", "shape", "dtype+close"...
    max_abs: float = 0.0
    max_rel: float = 0.0
    detail: str = ""


@dataclass
class DiffReport:
    """The comparison of checkpoints ``a`` and ``b``: one :class:`TensorDiff` per key, plus the
    non-tensor values that differ; ``equal`` is the verdict ``shardkit diff`` exits on."""

    a: str
    b: str
    atol: float
    rtol: float
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[str] = field(default_factory=list)   # names of non-tensor values that differ
    not_compared: dict[str, str] = field(default_factory=dict)  # values either side lists but cannot read: why
    scope: str = ""   # set when diff narrowed what it compares by itself (e.g. to the model part)

    @property
    def equal(self) -> bool:
        """True when every tensor is equal (or within tolerance) and every value equal."""
        return not self.values and all(t.status in ("equal", "close") for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        """The report as ``shardkit diff --json`` prints it."""
        return {"a": self.a, "b": self.b, "atol": self.atol, "rtol": self.rtol, "equal": self.equal,
                "scope": self.scope, "tensors": [t.__dict__ for t in self.tensors], "values_differ": self.values,
                "values_not_compared": self.not_compared}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def diff(a: str, b: str, *, atol: float = 0.0, rtol: float = 0.0, storage_options: Mapping[str, Any] | None = None,
         b_storage_options: Mapping[str, Any] | None = None, max_memory: int | str | None = None,
         only: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
         progress: Progress | None = None) -> DiffReport:
    """Per-tensor max abs / rel difference of ``a`` and ``b`` (any formats, any layouts).

    ``only``/``exclude`` are key globs limiting what is compared (e.g. ``model.*``).
    """
    if not (math.isfinite(atol) and atol >= 0) or not (math.isfinite(rtol) and rtol >= 0):
        raise ConfigurationError(f"--atol/--rtol must be finite and non-negative, got atol={atol}, rtol={rtol}")
    budget = parse_memory(max_memory)
    sa = open_reader(a, storage_options)
    sb = open_reader(b, storage_options if b_storage_options is None else b_storage_options)
    report = DiffReport(a, b, atol, rtol)
    try:
        ea, eb = sa.tensors(), sb.tensors()
        va, vb = sa.values(), sb.values()
        if not only and not exclude:
            only, report.scope = _model_scope(a, b, set(ea) | set(va), set(eb) | set(vb))

        def wanted(name: str) -> bool:
            return ((not only or any(fnmatch.fnmatchcase(name, g) for g in only))
                    and not (exclude and any(fnmatch.fnmatchcase(name, g) for g in exclude)))

        names = sorted(n for n in set(ea) | set(eb) if wanted(n))
        unread = {**sb.unreadable_values(), **sa.unreadable_values()}
        report.not_compared = {k: why for k, why in sorted(unread.items()) if wanted(k)}
        value_names = sorted(k for k in set(va) | set(vb) if wanted(k) and k not in unread)
        if not names and not value_names and not report.not_compared:
            raise ConfigurationError("the filters (--only/--exclude) keep no tensor or value of either checkpoint; "
                                     "nothing to compare" if (only or exclude) else
                                     f"{a} and {b} hold no tensor or value; nothing to compare")
        aa, ab = sa.aliases(), sb.aliases()
        tied = {n: t for n, t in aa.items() if ab.get(n) == t and wanted(t)}
        shared = [n for n in names if n in ea and n in eb and ea[n].shape == eb[n].shape and n not in tied]
        # a key one side holds and ties to a key the other holds: (key in a, key in b); the other side
        # stores it once under that key only when it says so too, else it merely lacks the key
        tied_in_a, tied_in_b = _kept_as(names, ea, aa, eb), _kept_as(names, eb, ab, ea)
        stored_once = {**{n: (n, k) for n, k in tied_in_a.items() if sb.declares_tied(n)},
                       **{n: (k, n) for n, k in tied_in_b.items() if sa.declares_tied(n)}}
        lacked = {**{n: f"tied to {k} in a; b does not record the tie"
                     for n, k in tied_in_a.items() if n not in stored_once},
                  **{n: f"tied to {k} in b; a does not record the tie"
                     for n, k in tied_in_b.items() if n not in stored_once}}
        direct = {n: keys for n, keys in stored_once.items() if keys[0] not in shared and keys[1] not in shared}
        fa, fb = Fetcher(sa, reuse=True), Fetcher(sb, reuse=True)
        if progress:
            progress.start("diff", sum(ea[n].nbytes + eb[n].nbytes for n in shared)
                           + sum(ea[ka].nbytes + eb[kb].nbytes for ka, kb in direct.values()
                                 if ea[ka].shape == eb[kb].shape))
        for name in (n for n in names if n not in tied and n not in stored_once):
            if name not in eb or name not in ea:
                report.tensors.append(TensorDiff(name, "only-a" if name in ea else "only-b",
                                                 detail=lacked.get(name, "")))
                continue
            report.tensors.append(_compare(name, ea[name], eb[name], fa, fb, atol, rtol, budget // 16, progress))
        verdicts = {t.name: t for t in report.tensors}
        for name, target in tied.items():
            t = verdicts[target]
            report.tensors.append(TensorDiff(name, t.status, t.max_abs, t.max_rel, f"tied to {target} on both sides"))
        for name, (ka, kb) in stored_once.items():
            holder, other, kept = ("a", "b", kb) if name == ka else ("b", "a", ka)
            # the same bytes as the kept key on the holder's side: its verdict, unless it was not compared
            t = _compare(name, ea[ka], eb[kb], fa, fb, atol, rtol, budget // 16, progress, (ka, kb)) \
                if name in direct else verdicts[kept]
            report.tensors.append(TensorDiff(name, t.status, t.max_abs, t.max_rel,
                                             f"{other} stores it once, as {kept} (tied to it in {holder})"))
        report.tensors.sort(key=lambda t: t.name)
        report.values = [k for k in value_names if
                         k not in va or k not in vb or not same_value(from_json_value(va[k]), from_json_value(vb[k]))]
    finally:
        sa.close()
        sb.close()
    if progress:
        progress.finish()
    return report


def _model_scope(a: str, b: str, keys_a: set[str], keys_b: set[str]) -> tuple[list[str] | None, str]:
    """``(["model.*"], why)`` when exactly one side holds only model keys (an HF export, a
    model-only torch file) and the other more (optimizer state): the model part is what they share."""
    def model_only(keys: set[str]) -> bool:
        return bool(keys) and all(n.startswith("model.") for n in keys)

    if model_only(keys_a) != model_only(keys_b):
        lean = a if model_only(keys_a) else b
        return ["model.*"], f"model.* only: {lean} holds only model weights (pass --only/--exclude to choose)"
    return None, ""


def same_value(a: Any, b: Any) -> bool:
    """Equality of decoded non-tensor values, where NaN equals NaN (a saved ``best_loss=nan`` is
    the same state on both sides) and a tuple equals a list (JSON has only lists)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b  # True is not 1 for a flag
    return a == b


def _kept_as(names: Sequence[str], here: Mapping[str, Any], aliases: Mapping[str, str],
             there: Mapping[str, Any]) -> dict[str, str]:
    """For each of ``names`` that one side holds (``here``) and the other (``there``) does not: the first
    other key of its tie, as ``aliases`` (this side's) records the tie, that the other side holds."""
    groups = alias_groups(aliases)
    kept = {n: next((k for k in groups.get(n, ()) if k != n and k in there), None)
            for n in names if n in here and n not in there}
    return {n: k for n, k in kept.items() if k is not None}


def _compare(name: str, ta: Any, tb: Any, fa: Fetcher, fb: Fetcher, atol: float, rtol: float, block: int,
             progress: Progress | None, keys: tuple[str, str] | None = None) -> TensorDiff:
    """``name``'s verdict: tensor ``ta`` of a against ``tb`` of b, read block by block under ``keys``
    (a's key, b's key; both ``name`` by default)."""
    key_a, key_b = keys or (name, name)
    if ta.shape != tb.shape:
        return TensorDiff(name, "shape", detail=f"{list(ta.shape)} vs {list(tb.shape)}")
    same_dtype = ta.dtype == tb.dtype
    bitwise = same_dtype
    max_abs = max_rel = 0.0
    within = True
    shape = ta.shape
    blocks = [(0, 1)] if not shape else list(iter_row_blocks(shape[0], rows_per_block(ta.dtype, shape, block)))
    for r0, r1 in blocks:
        off = (r0,) + (0,) * (len(shape) - 1) if shape else ()
        box = (r1 - r0,) + tuple(shape[1:]) if shape else ()
        x, y = fa.fetch(key_a, off, box), fb.fetch(key_b, off, box)
        if progress:
            progress.update(x.numel() * x.element_size() + y.numel() * y.element_size())
        if same_dtype and torch.equal(_bits(x), _bits(y)):
            continue  # bitwise equal block: no numeric work (the common case, and the costly one)
        bitwise = False
        if x.numel() == 0:
            continue
        if x.dtype.is_floating_point or x.dtype.is_complex or y.dtype.is_floating_point:
            xd, yd = x.to(torch.float64), y.to(torch.float64)
        else:
            xd, yd = x.to(torch.int64).to(torch.float64), y.to(torch.int64).to(torch.float64)
        d = (xd - yd).abs()
        nan_mismatch = torch.isnan(xd) != torch.isnan(yd)
        d = torch.where(torch.isnan(xd) & torch.isnan(yd), torch.zeros_like(d), d)
        if bool(nan_mismatch.any()):
            max_abs = float("inf")
            within = False
            continue
        max_abs = max(max_abs, float(d.max()))
        rel = d / yd.abs().clamp_min(torch.finfo(torch.float64).tiny)
        rel = torch.where(d == 0, torch.zeros_like(rel), rel)
        max_rel = max(max_rel, float(rel.max()))
        if not bool((d <= atol + rtol * yd.abs()).all()):
            within = False
    if bitwise:
        status = "equal"
    elif within and (atol > 0 or rtol > 0):
        status = "close"
    else:
        status = "different"
    detail = "" if same_dtype else f"dtype {ta.dtype} vs {tb.dtype}".replace("torch.", "")
    return TensorDiff(name, status, max_abs, max_rel, detail)
