"""``torch.compile`` with ``fully_shard``: per block (wrapping each block with
``torch.compile`` before or after sharding it, or ``block.compile()`` in
place) and the whole model train to the eager losses.

The sharding hooks run eagerly: dynamo breaks the graph at each of them and
compiles the module bodies in between (see ``shardkit/runtime/compile.py``).
The default inductor backend builds C++ kernels with the machine's compiler.
State-dict keys stay the eager model's: no ``_orig_mod.``.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.dist import run_on_ranks
from tests.support.runtime_common import (
    max_relative_loss_error,
    seeded_transformer,
    shard_blocks_and_root,
    train_sharded,
)

STEPS = 10
LOSS_RTOL = 1e-6


def _compile_blocks_before_sharding(model):
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer)
    return shard_blocks_and_root(model), None


def _compile_blocks_after_sharding(model):
    shard_blocks_and_root(model)
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer)
    return model, None


def _compile_blocks_in_place(model):
    for layer in model.layers:
        layer.compile()
    return shard_blocks_and_root(model), None


def _compile_whole_model(model):
    shard_blocks_and_root(model)
    compiled = torch.compile(model)
    return model, lambda _, tokens: compiled(tokens)


WAYS = {"blocks_before_fully_shard": _compile_blocks_before_sharding,
        "blocks_after_fully_shard": _compile_blocks_after_sharding,
        "blocks_in_place": _compile_blocks_in_place,
        "whole_model": _compile_whole_model}


def _train_eager_and_compiled(way):
    import torch._dynamo

    eager = shard_blocks_and_root(seeded_transformer())
    eager_losses = train_sharded(eager, STEPS)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model, forward = WAYS[way](seeded_transformer())
    losses = train_sharded(model, STEPS, forward=forward)
    graphs = counters["stats"]["unique_graphs"]
    inductor_graphs = counters["inductor"]["fxgraph_cache_hit"] + counters["inductor"]["fxgraph_cache_miss"]
    keys = list(model.state_dict())
    model.load_state_dict(eager.state_dict())  # strict: eager names load into the compiled layout
    loaded = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), eager.parameters()))
    return {"eager": eager_losses, "compiled": losses, "graphs": graphs, "inductor_graphs": inductor_graphs,
            "keys": keys, "eager_keys": list(eager.state_dict()), "loaded_eager_state": loaded}


@pytest.mark.parametrize("way", list(WAYS))
def test_compiled_training_matches_eager_losses(way):
    for out in run_on_ranks(2, _train_eager_and_compiled, way):
        # the block's forward is one graph (the hooks break it off), forward and backward built by inductor
        assert out["graphs"] == 1 and out["inductor_graphs"] == 2
        assert max_relative_loss_error(out["compiled"], out["eager"]) <= LOSS_RTOL, (out["compiled"], out["eager"])
        assert out["keys"] == out["eager_keys"]  # no "_orig_mod." anywhere
        assert out["loaded_eager_state"]
