"""The names of parameters under wrapper modules, as the unwrapped model spells them.

A wrapper module puts a path part between a module and what it wraps:
``torch.compile``'s ``OptimizedModule`` adds ``_orig_mod``, activation
checkpointing ``_checkpoint_wrapped_module``, FSDP1 ``_fsdp_wrapped_module``,
DDP ``_dp_wrapped_module``.  ``named_parameters()`` keeps them; state-dict keys
do not (each wrapper's state-dict hooks drop its own part), and checkpoints
are keyed as the eager model spells them.  Hence two rules:

* :func:`eager_fqn` drops every wrapper part: the name a checkpoint keys a
  parameter by, used to match ``named_parameters()`` against state dicts.
* :func:`without_compile_parts` drops ``_orig_mod`` only: the sharding
  runtime's state-dict hooks own that part alone (it is the one no torch hook
  removes), and on load they must map a key back onto exactly the path the
  compile wrapper made, leaving the other wrappers' parts to those wrappers'
  own load hooks, which add them.
"""

from __future__ import annotations

__all__ = ["COMPILE_PART", "WRAPPER_PARTS", "eager_fqn", "without_compile_parts"]

COMPILE_PART = "_orig_mod"
WRAPPER_PARTS = (COMPILE_PART, "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_dp_wrapped_module")


def eager_fqn(name: str) -> str:
    """``name`` without any wrapper part (``torch.compile``, activation checkpointing, FSDP1, DDP)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def without_compile_parts(name: str) -> str:
    """``name`` without the ``_orig_mod`` parts a ``torch.compile`` wrapper adds, and nothing else."""
    if COMPILE_PART not in name:
        return name
    return ".".join(part for part in name.split(".") if part != COMPILE_PART)
