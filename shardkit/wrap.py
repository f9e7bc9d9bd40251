"""FSDP1-style auto-wrap policies, and applying ``fully_shard`` where they say.

A *policy* answers two questions about each module, FSDP1's callable
contract ``policy(module, recurse, nonwrapped_numel) -> bool``:

* ``recurse=True``: should the traversal descend into this module's children?
  ``nonwrapped_numel`` is the parameter count of the whole subtree.
* ``recurse=False``: should this module become its own sharding unit?
  ``nonwrapped_numel`` is what remains after the children that became units.

The traversal is post-order (children first), which is exactly the bottom-up
order ``fully_shard`` needs: each call groups the parameters of its subtree
that no inner call took.  The root always becomes a unit last.

Two differences from ``torch.distributed.fsdp.wrap`` follow from the core:

* A container without its own ``forward`` (``nn.ModuleList``, ``nn.ModuleDict``)
  cannot be a unit: its hooks would never run.  When a policy picks one, it is
  skipped with a warning and its parameters join the enclosing unit.
* Nothing is wrapped: ``fully_shard`` changes modules in place, so module
  names, FQNs and ``state_dict()`` keys stay those of the original model.

Usage::

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    apply_fully_shard(model, policy, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from shardkit.errors import ConfigurationError
from shardkit.runtime import FSDPModule, fully_shard

__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "ModuleWrapPolicy",
    "CustomPolicy",
    "WrapTarget",
    "plan_auto_wrap",
    "walk_modules",
    "ignored_parameters",
    "warn_once",
    "apply_fully_shard",
    "enable_wrap",
    "wrap",
]

WrapPolicy = Callable[..., bool]


# --------------------------------------------------------------------------
# callable policies (FSDP1 contract)


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Descend everywhere and make every module with a ``forward`` a unit."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Make ``module`` a unit when ``lambda_fn(module)`` is true; always descend."""
    if recurse:
        return True
    return bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type[nn.Module]]) -> bool:
    """Make every instance of ``transformer_layer_cls`` (e.g. the decoder block) a unit.

    Parameters shared between blocks (tied embeddings) must live in one unit;
    leaving them to the root, as this policy does, satisfies that.
    """
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: set[type[nn.Module]] | None = None,
                                exclude_wrap_modules: set[type[nn.Module]] | None = None) -> bool:
    """Make a module a unit once it holds at least ``min_num_params`` parameters
    that no inner unit took.

    ``force_leaf_modules`` (default ``{nn.MultiheadAttention}``) are never
    descended into; ``exclude_wrap_modules`` (default ``{nn.ModuleList,
    nn.ModuleDict}``) never become units.  Defaults are FSDP1's and live on the
    function as ``FORCE_LEAF_MODULES`` / ``EXCLUDE_WRAP_MODULES``.
    """
    leaves = (size_based_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
              if force_leaf_modules is None else force_leaf_modules)
    excluded = (size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
                if exclude_wrap_modules is None else exclude_wrap_modules)
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(leaves))
    return is_large and not isinstance(module, tuple(excluded))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
               policies: Iterable[WrapPolicy]) -> bool:
    """True when any of ``policies`` says so (FSDP1 exposes this privately; kept
    under the same name so existing imports work)."""
    return any(p(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for p in policies)


# --------------------------------------------------------------------------
# object policies: pick targets by looking at every module once


class ModuleWrapPolicy:
    """Make every instance of ``module_classes`` a unit (the root is always one).

    Also callable with the FSDP1 contract, so it composes with ``_or_policy``.
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self._module_classes = frozenset(module_classes)

    def select(self, module: nn.Module) -> bool | dict[str, Any]:
        return isinstance(module, tuple(self._module_classes))

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return True if recurse else isinstance(module, tuple(self._module_classes))

    def __repr__(self) -> str:
        names = sorted(c.__name__ for c in self._module_classes)
        return f"ModuleWrapPolicy({{{', '.join(names)}}})"


class CustomPolicy:
    """``lambda_fn(module)`` returns ``False`` (not a unit), ``True`` (a unit with
    the root's arguments) or a non-empty dict (a unit whose arguments are the
    root's updated with the dict, e.g. ``{"sharding_strategy": SHARD_GRAD_OP}``).
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        self._lambda_fn = lambda_fn

    def select(self, module: nn.Module) -> bool | dict[str, Any]:
        result = self._lambda_fn(module)
        if not isinstance(result, (bool, dict)):
            raise ConfigurationError(
                f"CustomPolicy's lambda_fn returned {result!r} for {type(module).__name__}; "
                "return True, False or a dict of argument overrides")
        return result


# --------------------------------------------------------------------------
# planning: which modules become units, in which order


@dataclass(frozen=True)
class WrapTarget:
    """One module to shard, and the argument overrides a ``CustomPolicy`` gave it."""

    module: nn.Module
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)


def _has_own_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


warned_keys: set[str] = set()


def warn_once(key: str, message: str, *, stacklevel: int = 3) -> None:
    """Warn once per process and ``key`` that a request cannot be honoured as
    asked (never silently; never once per module or per call).  Shared by
    the policies here and the FSDP1 surface."""
    if key not in warned_keys:
        warned_keys.add(key)
        warnings.warn(message, UserWarning, stacklevel=stacklevel)


def walk_modules(root: nn.Module, *, enter: Callable[[nn.Module], bool] | None = None,
                 children_first: bool = False) -> list[nn.Module]:
    """``root`` and the modules below it, each once, in depth-first order
    (parents first, or children first with ``children_first``).  A child for
    which ``enter(child)`` is false is skipped together with its subtree."""
    order: list[nn.Module] = []
    seen: set[nn.Module] = set()

    def visit(module: nn.Module) -> None:
        seen.add(module)
        if not children_first:
            order.append(module)
        for child in module.children():
            if child not in seen and (enter is None or enter(child)):
                visit(child)
        if children_first:
            order.append(module)

    visit(root)
    return order


def ignored_parameters(ignored_modules: Iterable[nn.Module] | None) -> set[nn.Parameter]:
    """Every parameter in the subtrees of ``ignored_modules``: no unit shards them."""
    return {p for module in ignored_modules or () for p in module.parameters()}


def _expand_ignored(ignored_modules: Iterable[nn.Module] | None) -> set[nn.Module]:
    expanded: set[nn.Module] = set()
    for module in ignored_modules or ():
        if module not in expanded:
            expanded.update(module.modules())
    return expanded


def plan_auto_wrap(root: nn.Module, policy: WrapPolicy | ModuleWrapPolicy | CustomPolicy | None,
                   *, ignored_modules: Iterable[nn.Module] | None = None) -> list[WrapTarget]:
    """The modules (root excluded) that ``policy`` makes units, children before parents.

    Callable policies are evaluated exactly as FSDP1's recursive wrap does
    (``recurse=True`` with the subtree's numel, then ``recurse=False`` with the
    remainder after inner units).  ``ModuleWrapPolicy`` and ``CustomPolicy``
    look at each module once.  Ignored modules and their subtrees are never
    units and their parameters are not counted.  Modules without their own
    ``forward`` are dropped with a warning.  Modules already sharded (by an
    earlier ``fully_shard``) are not planned again.
    """
    if policy is None:
        return []
    ignored = _expand_ignored(ignored_modules)  # the only expansion: callers pass the modules as given
    ignored_params = ignored_parameters(ignored_modules)
    names = {m: n for n, m in root.named_modules()}
    chosen: list[tuple[nn.Module, dict[str, Any]]] = []

    if hasattr(policy, "select"):
        picked = {}
        for module in root.modules():
            if module in ignored:
                continue
            verdict = policy.select(module)  # type: ignore[union-attr]
            if verdict:
                picked[module] = dict(verdict) if isinstance(verdict, dict) else {}
        in_order = walk_modules(root, enter=lambda m: m not in ignored, children_first=True)
        chosen = [(m, picked[m]) for m in in_order if m in picked]
    else:
        visited: set[nn.Module] = set()

        def visit(module: nn.Module, is_root: bool) -> int:
            """Returns the numel that ended up in units at or below ``module``."""
            visited.add(module)
            numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
            if not policy(module=module, recurse=True, nonwrapped_numel=numel):
                return 0
            wrapped = 0
            for child in module.children():
                if child not in ignored and child not in visited:
                    wrapped += visit(child, False)
            if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
                chosen.append((module, {}))
                return numel
            return wrapped

        visit(root, True)

    targets = []
    for module, overrides in chosen:
        if module is root or isinstance(module, FSDPModule):
            continue
        if not _has_own_forward(module):
            warn_once(f"container:{type(module).__name__}",
                       f"auto_wrap_policy chose {names.get(module, '?')!r} ({type(module).__name__}), "
                       "which has no forward of its own, so sharding hooks on it would never run; "
                       "its parameters join the enclosing unit instead")
            continue
        targets.append(WrapTarget(module, names.get(module, ""), overrides))
    return targets


# --------------------------------------------------------------------------
# applying


def apply_fully_shard(module: nn.Module,
                      auto_wrap_policy: WrapPolicy | ModuleWrapPolicy | CustomPolicy | None,
                      *, ignored_modules: Iterable[nn.Module] | None = None,
                      shard_fn: Callable[..., Any] | None = None,
                      **fully_shard_kwargs: Any) -> nn.Module:
    """Call ``fully_shard`` on every module ``auto_wrap_policy`` picks, bottom-up,
    then on ``module`` itself; return ``module`` (sharded in place).

    ``fully_shard_kwargs`` go to every call; a ``CustomPolicy`` dict updates
    them for its module.  ``shard_fn`` replaces ``shardkit.fully_shard`` (the
    FSDP1 surface passes its own).  The parameters of ``ignored_modules`` are
    passed on as ``ignored_params`` so that no unit shards them.
    """
    shard_fn = shard_fn or fully_shard
    ignored_modules = list(ignored_modules or ())
    if ignored_modules:
        extra = ignored_parameters(ignored_modules)
        fully_shard_kwargs["ignored_params"] = set(fully_shard_kwargs.get("ignored_params") or ()) | extra
    for target in plan_auto_wrap(module, auto_wrap_policy, ignored_modules=ignored_modules):
        shard_fn(target.module, **{**fully_shard_kwargs, **target.overrides})
    shard_fn(module, **fully_shard_kwargs)
    return module


# --------------------------------------------------------------------------
# manual annotation (FSDP1's enable_wrap / wrap)


class _WrapContext:
    wrapper_cls: Callable[..., Any] | None = None
    kwargs: dict[str, Any] = {}


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable[..., Any], **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Inside this context, :func:`wrap` applies ``wrapper_cls(module, **wrapper_kwargs)``."""
    if _WrapContext.wrapper_cls is not None:
        raise ConfigurationError("enable_wrap contexts cannot be nested; leave the outer one first")
    _WrapContext.wrapper_cls, _WrapContext.kwargs = wrapper_cls, dict(wrapper_kwargs)
    try:
        yield
    finally:
        _WrapContext.wrapper_cls, _WrapContext.kwargs = None, {}


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Apply the :func:`enable_wrap` wrapper to ``module``; outside the context, return it unchanged."""
    if _WrapContext.wrapper_cls is None:
        return module
    return _WrapContext.wrapper_cls(module, **{**_WrapContext.kwargs, **wrap_overrides})
