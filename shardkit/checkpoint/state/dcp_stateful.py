"""torch DCP's ``Stateful`` protocol at the top of a state dict, as ``dcp.save`` and ``dcp.load`` apply it.

torch's DCP tutorial saves ``{"app": AppState(model, optimizer)}``: an object
with ``state_dict()`` and ``load_state_dict()``
(``torch.distributed.checkpoint.stateful.Stateful``, a runtime-checkable
protocol that ``nn.Module`` and ``Optimizer`` match too).  For code written for
DCP to run after the import swap, ``save``/``async_save``/``load`` treat such
values exactly as DCP does, and only at the top level, as DCP does:

* saving stores ``value.state_dict()`` under the value's key;
* loading first calls ``state_dict()`` to get the targets, loads into them in
  place, then calls ``load_state_dict(targets)`` -- the object decides what
  loading means (``set_state_dict`` in the tutorial), so it runs even when
  the targets are the object's live tensors.  Other top-level values are
  replaced by what was loaded, as DCP replaces them.

This is torch's protocol; :class:`shardkit.data.Stateful` is something else: a
wrapper saying whether a *data* object's state is global or per rank, for
``CheckpointManager(..., stateful=...)``.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["is_stateful", "stateful_to_state_dict", "load_into_statefuls"]


def is_stateful(value: Any) -> bool:
    """``isinstance(value, torch.distributed.checkpoint.stateful.Stateful)``, without importing DCP.

    Why: torch's ``Stateful`` is a runtime-checkable protocol, so the check is whether ``value`` has both
    methods; importing ``torch.distributed.checkpoint`` to ask it costs most of a second on the first save of a
    process that never uses DCP.
    """
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def stateful_to_state_dict(state_dict: Any) -> Any:
    """A shallow copy of ``state_dict`` with ``value.state_dict()`` for each top-level ``Stateful`` value, keys in
    sorted order (the order DCP's load calls them in).  A state dict without one (or anything but a dict, which
    the caller's own check names) is returned as it is: nothing to do, and a load goes on filling it directly."""
    if not isinstance(state_dict, Mapping) or not any(is_stateful(v) for v in state_dict.values()):
        return state_dict
    return {key: value.state_dict() if is_stateful(value) else value
            for key, value in sorted(state_dict.items(), key=lambda item: str(item[0]))}


def load_into_statefuls(state_dict: dict[str, Any], targets: Any, *, statefuls: bool = True) -> None:
    """After ``targets`` (what :func:`stateful_to_state_dict` gave for ``state_dict``) were loaded in place: put
    every other loaded value back in ``state_dict`` (a top-level value the load replaced in ``targets``), and
    with ``statefuls`` hand each ``Stateful`` its loaded state through ``load_state_dict`` -- ``False`` after
    a failed load, whose replaced values stay visible, as a load without a ``Stateful`` leaves them."""
    if targets is state_dict or not isinstance(state_dict, dict):
        return
    for key in sorted(state_dict, key=str):
        value = state_dict[key]
        if not is_stateful(value):
            state_dict[key] = targets[key]
        elif statefuls:
            value.load_state_dict(targets[key])
