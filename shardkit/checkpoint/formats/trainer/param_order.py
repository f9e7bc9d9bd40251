"""The parameter order behind an optimizer state keyed by number, from the checkpoint's ``config.json``.

A DDP-fallback checkpoint's ``optimizer.pt``/``optimizer.bin`` is torch's
``optimizer.state_dict()``: state keyed by parameter *number*, in the order
the optimizer was given the parameters.  The weights beside it
(``model.safetensors``) are sorted by name, so they cannot tell that order.
The model's class can: ``config.json`` names it (``architectures``), and
building it on the meta device (no memory, no weights, and only classes
``transformers`` ships: no ``trust_remote_code``) gives ``named_parameters()``.

Two groupings are tried, as the optimizers these frameworks build group them:
one group in ``named_parameters()`` order (``AdamW(model.parameters())``), and
the Trainer's two (parameters with weight decay, then those without, each in
that order; ``Trainer.get_decay_parameter_names``).  A grouping is used only
when its group sizes equal the param groups' and every state tensor has the
shape of the parameter it names; otherwise the numbers stay unnamed and the
caller says so.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Sequence

from shardkit.checkpoint.io.storage import Storage

__all__ = ["named_groupings", "fits"]

log = logging.getLogger(__name__)


def _meta_model(config: Mapping[str, Any]) -> Any:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    archs = config.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs and isinstance(archs[0], str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        return None  # only a model class: a config naming anything else builds nothing
    try:
        cfg = transformers.AutoConfig.for_model(**config)
        with torch.device("meta"):
            return cls(cfg)
    except Exception as exc:  # a config transformers cannot build: no order, said in the debug log
        log.debug("cannot build %s from config.json on the meta device: %s", archs[0], exc)
        return None


def _decay_names(model: Any) -> list[str] | None:
    try:
        from transformers import Trainer
    except ImportError:
        return None
    try:
        return list(Trainer.get_decay_parameter_names(None, model))
    except Exception as exc:
        log.debug("Trainer.get_decay_parameter_names failed: %s", exc)
        return None


def named_groupings(folder: Storage) -> list[tuple[list[list[str]], dict[str, tuple[int, ...]]]]:
    """Candidate ``(names per param group, parameter shapes)`` from ``folder``'s ``config.json``
    (none without one, or without ``transformers``)."""
    if not folder.exists("config.json"):
        return []
    try:
        config = json.loads(folder.read_bytes("config.json"))
    except (ValueError, UnicodeError):
        return []
    model = _meta_model(config) if isinstance(config, dict) else None
    if model is None:
        return []
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    shapes = {n: tuple(p.shape) for n, p in params}
    names = [n for n, _ in params]
    out = [([names], shapes)]
    decay = _decay_names(model)
    if decay is not None:
        decayed = set(decay)
        out.append(([[n for n in names if n in decayed], [n for n in names if n not in decayed]], shapes))
    return out


def fits(grouping: Sequence[Sequence[str]], param_shapes: Mapping[str, tuple[int, ...]],
         groups: Sequence[Mapping[str, Any]], state_shapes: Mapping[tuple[str, str], tuple[int, ...]],
         shaped_keys: Sequence[str]) -> bool:
    """Whether ``grouping`` names the numbers of ``groups`` (the param groups): the same group sizes, and
    every per-parameter state tensor (``shaped_keys``; ``state_shapes`` by ``(number, key)``) with its
    parameter's shape (when ``param_shapes`` knows it)."""
    if len(groups) != len(grouping) or any(len(g.get("params", ())) != len(n) for g, n in zip(groups, grouping)):
        return False
    for group, names in zip(groups, grouping):
        for number, name in zip(group["params"], names):
            for key in shaped_keys:
                shape = state_shapes.get((str(number), key))
                if shape is not None and name in param_shapes and shape != param_shapes[name]:
                    return False
    return True
