"""A nested state dict that only rank 0 holds, sent to every rank one tensor at a time.

torch's ``StateDictOptions(broadcast_from_rank0=True)`` loads a full state dict
that exists on rank 0 alone (the others build the model on ``meta`` or skip
reading the file).  Every rank first needs the structure -- keys, non-tensor
values, each tensor's shape and dtype -- and then each tensor's values, which
it cuts to its own layout at once so that no rank ever holds two full tensors.
The structure travels as JSON (no pickle); dict keys keep their type (an
optimizer's nested state may use integers) and tuples stay tuples.  What JSON
cannot carry is refused while rank 0 describes the tree, inside its decision,
so every rank raises the same error instead of the others waiting for rank 0.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardkit.checkpoint.io.dist import Dist
from shardkit.errors import IncompatibleStateDict

__all__ = ["broadcast_tree", "is_json_value"]

Path = tuple[Any, ...]


def _encode(value: Any, path: Path) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": [list(value.shape), str(value.dtype).removeprefix("torch.")]}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, (str, int)):
                raise IncompatibleStateDict(f"{'.'.join(map(str, (*path, key)))!r}: the key {key!r} is a "
                                            f"{type(key).__name__}; a state dict broadcast from rank 0 has string "
                                            "or integer keys only (use the parameter's FQN)")
        return {"dict": [[k, _encode(v, (*path, k))] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"tuple" if isinstance(value, tuple) else "list": [_encode(v, (*path, i)) for i, v in enumerate(value)]}
    if is_json_value(value):
        return {"value": value}
    raise IncompatibleStateDict(f"{'.'.join(map(str, path))!r} is a {type(value).__name__}; a state dict broadcast "
                                "from rank 0 holds tensors, dicts, lists, tuples and JSON values only")


def is_json_value(value: Any) -> bool:
    """A JSON scalar (``None``, bool, int, float, str) or a list or tuple of them: a non-tensor leaf the
    description of a tree carries as is."""
    if isinstance(value, (list, tuple)):
        return all(is_json_value(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _decode(node: dict[str, Any], path: Path, tensors: list[tuple[Path, list[int], torch.dtype]]) -> Any:
    kind, body = next(iter(node.items()))
    if kind == "tensor":
        tensors.append((path, body[0], getattr(torch, body[1])))
        return None  # filled in by the tensor's broadcast
    if kind == "dict":
        return {k: _decode(v, (*path, k), tensors) for k, v in body}
    if kind in ("list", "tuple"):
        items = [_decode(v, (*path, i), tensors) for i, v in enumerate(body)]
        return tuple(items) if kind == "tuple" else items
    return body


def _slot(tree: Any, path: Path) -> tuple[Any, Any]:
    for key in path[:-1]:
        tree = tree[key]
    return tree, path[-1]


def _wire_device(dist: Dist) -> torch.device:
    """Where a broadcast buffer must live: the GPU for NCCL, else the CPU."""
    if not dist.active:
        return torch.device("cpu")
    import torch.distributed as tdist

    return torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_tree(make: Callable[[], Any], cut: Callable[[Path, torch.Tensor], Any], dist: Dist | None = None
                   ) -> Any:
    """The tree ``make()`` returns on rank 0, on every rank, with each tensor replaced by ``cut(path, full_tensor)``.

    ``make`` runs on rank 0 only; what it raises there is raised on every
    rank (the others do not wait for tensors that never come).  ``cut`` runs on every rank as each
    tensor arrives (rank 0 gets its own tensor): it returns what the rank keeps
    of it, e.g. its shard of a parameter, so the full copy is freed before the
    next tensor is sent.  Collective over the default group (every rank calls
    it); a tree rank 0 cannot describe raises on every rank.
    """
    dist = dist or Dist()
    tree = None

    def describe() -> Any:
        nonlocal tree
        tree = make()
        return _encode(tree, ())

    skeleton = dist.decided_on_rank0(describe, "broadcast_from_rank0")
    tensors: list[tuple[Path, list[int], torch.dtype]] = []
    out = _decode(skeleton, (), tensors)
    device = _wire_device(dist)
    for path, shape, dtype in tensors:
        if dist.rank == 0:
            container, key = _slot(tree, path)
            full = container[key].detach().to(device).contiguous()
        else:
            full = torch.empty(shape, dtype=dtype, device=device)
        if dist.active:
            import torch.distributed as tdist

            tdist.broadcast(full, 0)
        if path:
            container, key = _slot(out, path)
            if isinstance(container, tuple):
                raise IncompatibleStateDict(f"{'.'.join(map(str, path))!r}: a tensor inside a tuple cannot be "
                                            "broadcast from rank 0; use a list")
            container[key] = cut(path, full)
        else:
            out = cut(path, full)
    return out
