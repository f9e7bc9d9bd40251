"""``torch.compile`` around sharded modules.

Note [hooks run eagerly]
    ``torch.compile(block)`` (or ``block.compile()``, or compiling the whole
    model) makes dynamo trace ``block.__call__``, hooks included.  The
    sharding hooks are Python state machines that issue collectives, resize
    storages and swap registered parameters; tracing them would either fail
    or, worse, bake one iteration's state into a graph.  So each hook is
    wrapped: outside a trace it is a plain call (no cost in eager mode), and
    while dynamo traces it the call goes through ``torch._dynamo.disable``,
    which makes dynamo break the graph there and run the hook eagerly.  The
    module's forward between the hooks is compiled as usual, with the
    unsharded parameters as graph inputs: the same Parameter objects every
    iteration, whose storage the hooks free and refill, exactly as autograd
    already sees them in eager mode.

Note [state-dict keys of compiled blocks]
    ``model.layers[i] = torch.compile(block)`` puts an ``OptimizedModule``
    between the model and the block, and ``nn.Module`` names everything below
    it ``layers.<i>._orig_mod.<...>``.  A checkpoint written by a compiled run
    would then not load into an eager one.  Every sharded module therefore
    drops ``_orig_mod.`` from the state-dict keys below it, and maps eager
    keys back onto ``_orig_mod.`` paths when loading.  (``block.compile()``,
    which compiles in place, never changes a name.)
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import torch
import torch.nn as nn

from shardkit.wire.fqn import COMPILE_PART, without_compile_parts

__all__ = ["eager_hook", "unwrap_compiled", "keep_state_dict_keys_clean"]

_F = TypeVar("_F", bound=Callable[..., Any])


def eager_hook(fn: _F) -> _F:
    """Run ``fn`` eagerly even when dynamo traces its caller (see Note [hooks run eagerly])."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # only while dynamo traces: torch._dynamo is imported
            return torch._dynamo.disable(fn, recursive=True, reason="shardkit's sharding hooks run eagerly")(
                *args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper compiles (itself otherwise)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing was compiled
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return unwrap_compiled(module._orig_mod)
    return module


def _strip_compiled_keys(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    # every sharded module's hook sees the whole dict built so far: scanning its keys in each of them made a
    # 200-layer state_dict() quadratic; a module with no compiled block below it has nothing to strip
    if not _has_compiled_block(module):
        return
    keys = list(state_dict)
    if not any(COMPILE_PART in key[len(prefix):] for key in keys if key.startswith(prefix)):
        return
    items = [(prefix + without_compile_parts(key[len(prefix):]) if key.startswith(prefix) else key, state_dict[key])
             for key in keys]
    state_dict.clear()
    state_dict.update(items)  # same order, eager names


def _has_compiled_block(module: nn.Module) -> bool:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing was compiled
    return eval_frame is not None and any(isinstance(m, eval_frame.OptimizedModule) for m in module.modules())


def _restore_compiled_keys(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    real = [name for name, _ in module.named_parameters(remove_duplicate=False)]
    real += [name for name, _ in module.named_buffers(remove_duplicate=False)]
    renames = {prefix + without_compile_parts(name): prefix + name for name in real if COMPILE_PART in name}
    for clean, name in renames.items():
        if clean in state_dict and name not in state_dict:
            state_dict[name] = state_dict.pop(clean)


def keep_state_dict_keys_clean(module: nn.Module) -> None:
    """Register the hooks of Note [state-dict keys of compiled blocks] on ``module``."""
    module.register_state_dict_post_hook(_strip_compiled_keys)
    module.register_load_state_dict_pre_hook(_restore_compiled_keys)
