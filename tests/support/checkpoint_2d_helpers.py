"""Helpers of the 2-D checkpoint tests: a tensor-parallel model, the layouts of the matrix, the runtimes.

A *layout* names how the job is parallel (``dp2tp2`` is FSDP over 2 ranks
composed with tensor parallelism over 2, ``fsdp3`` plain FSDP over 3 ranks,
``plain`` one process without any sharding).  A *runtime* is what builds the
sharded model: ``torch`` (``torch.distributed.fsdp.fully_shard`` +
``torch.distributed.tensor.parallel.parallelize_module``) or ``shardkit``
(``shardkit.fully_shard``; its tensor parallelism lives on another branch, so
it covers the layouts without ``tp`` today).  Adding shardkit's 2-D runtime to
the matrix is one entry in :data:`RUNTIMES` and one line in the test's list.

Every layout trains on the same fixed global batches: data-parallel rank ``d``
of ``D`` takes rows ``[d*12/D, (d+1)*12/D)`` (12 divides 1..4) and the
tensor-parallel ranks of one data-parallel rank see the same rows, so every
layout optimises the same global mean loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.support.checkpoint_helpers import full_state, mismatches, rel_close, train_rows  # noqa: F401 - re-exported
from tests.support.models import ModelArgs

VOCAB, DIM, HIDDEN, LAYERS, SEQ = 37, 26, 51, 2, 8  # 37, 51 divide none of 2, 3, 4; 26 divides 2 only
LR = 1e-2
BATCH_ARGS = ModelArgs(vocab_size=VOCAB, max_seq_len=SEQ)


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class TPNet(nn.Module):
    """Embedding, MLP blocks, norm, output: what tensor parallelism cuts (w1, w2, output) and what it
    leaves to FSDP alone (emb, norms), each with dims that do not divide the world."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MLPBlock(dim, hidden) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


@dataclass(frozen=True)
class Layout:
    """How a job is parallel: ``mesh`` over ``names`` (``rep``: HSDP replicas, ``dp``: FSDP shards,
    ``tp``: tensor parallel); an empty mesh is one process with plain tensors."""

    name: str
    mesh: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def world(self) -> int:
        return math.prod(self.mesh) if self.mesh else 1

    @property
    def tp(self) -> bool:
        return "tp" in self.names


LAYOUTS = {layout.name: layout for layout in [
    Layout("dp2tp2", (2, 2), ("dp", "tp")),
    Layout("dp4tp1", (4, 1), ("dp", "tp")),
    Layout("dp1tp4", (1, 4), ("dp", "tp")),
    Layout("dp1tp2", (1, 2), ("dp", "tp")),
    Layout("fsdp3", (3,), ("dp",)),
    Layout("hsdp1x2tp2", (1, 2, 2), ("rep", "dp", "tp")),
    Layout("plain", (), ()),
]}


def _tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # w1's output stays a DTensor: its 51 columns do not divide the tp ranks, and a local tensor handed
    # to w2 would be taken for an even shard (DTensor.from_local assumes one)
    plan: dict[str, Any] = {"output": ColwiseParallel(output_layouts=Replicate())}
    for i in range(LAYERS):
        plan[f"layers.{i}.w1"] = ColwiseParallel(use_local_output=False)
        plan[f"layers.{i}.w2"] = RowwiseParallel()
    return plan


def _torch_runtime() -> tuple[Callable[..., Any], Callable[..., Any] | None]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    return fully_shard, parallelize_module


def _shardkit_runtime() -> tuple[Callable[..., Any], Callable[..., Any] | None]:
    from torch.distributed.tensor.parallel import parallelize_module

    from shardkit import fully_shard

    return fully_shard, parallelize_module  # torch's tensor parallelism, shardkit's FSDP over dp


# runtime name -> (fully_shard, parallelize_module or None)
RUNTIMES: dict[str, Callable[[], tuple[Callable[..., Any], Callable[..., Any] | None]]] = {
    "torch": _torch_runtime,
    "shardkit": _shardkit_runtime,
}


def build(runtime: str, layout: Layout, seed: int, dims: tuple[int, int, int] = (VOCAB, DIM, HIDDEN)) -> nn.Module:
    """``TPNet(*dims)`` seeded with ``seed`` and laid out as ``layout`` by ``runtime`` (on every rank)."""
    torch.manual_seed(seed)
    model = TPNet(*dims)
    if not layout.mesh:
        return model
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, parallelize = RUNTIMES[runtime]()
    mesh = init_device_mesh("cpu", layout.mesh, mesh_dim_names=layout.names)
    if layout.tp:
        if parallelize is None:
            raise NotImplementedError(f"runtime {runtime!r} has no tensor parallelism yet")
        parallelize(model, mesh["tp"], _tp_plan())
    dp_names = tuple(n for n in layout.names if n != "tp")
    dp_mesh = mesh[dp_names] if len(dp_names) > 1 or layout.tp else mesh
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def dp_rank_and_size(layout: Layout) -> tuple[int, int]:
    """This rank's data-parallel rank and the data-parallel size (tensor-parallel ranks share a rank)."""
    if not layout.mesh:
        return 0, 1
    tp = layout.mesh[layout.names.index("tp")] if layout.tp else 1
    return dist.get_rank() // tp, layout.world // tp


def train(model: nn.Module, opt: torch.optim.Optimizer, layout: Layout, steps: range) -> list[float]:
    """Steps on this rank's rows of each fixed global batch; the global mean loss of each step."""
    rank, size = dp_rank_and_size(layout)
    return train_rows(model, opt, steps, BATCH_ARGS, rank, size, layout.world)


def on_rank0(value: Any) -> Any:
    return value if not dist.is_initialized() or dist.get_rank() == 0 else None


def train_save_continue(url: str, runtime: str, layout_name: str) -> dict[str, Any] | None:
    """The uninterrupted run: 5 steps, save (with its full state on rank 0), 5 more steps."""
    import shardkit.checkpoint as skc

    layout = LAYOUTS[layout_name]
    model = build(runtime, layout, seed=0)
    opt = optimizer(model)
    first = train(model, opt, layout, range(5))
    skc.save(skc.get_training_state(model, opt), url, meta={"step": 5})
    saved = full_state(model, opt)
    rest = train(model, opt, layout, range(5, 10))
    return on_rank0({"losses": first + rest, "saved": saved})


def resume(url: str, runtime: str, layout_name: str) -> dict[str, Any] | None:
    """A fresh model (another seed) and optimizer loaded from ``url``: its full state, 5 more steps."""
    import shardkit.checkpoint as skc

    layout = LAYOUTS[layout_name]
    model = build(runtime, layout, seed=123)
    opt = optimizer(model)
    sd = skc.get_training_state(model, opt)
    meta = skc.load(sd, url)
    skc.set_training_state(model, opt, sd)
    loaded = full_state(model, opt)
    return on_rank0({"meta": meta, "loaded": loaded, "losses": train(model, opt, layout, range(5, 10))})


def run_layout(layout_name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the ranks of the layout (in this process for ``plain``); rank 0's answer."""
    from tests.support.dist import run_on_ranks

    layout = LAYOUTS[layout_name]
    if not layout.mesh:
        return fn(*args)
    return run_on_ranks(layout.world, fn, *args)[0]
