"""Communication: how many collectives a step issues, and in what order.

Counted with ``CommDebugMode`` (it sees gloo's ``_allgather_base_``,
``_reduce_scatter_base_`` and ``allreduce_``).  With per-block ``fully_shard``
and the default policy (blocks reshard after forward, the root keeps its
parameters): forward = one all-gather per group; backward = one all-gather
per non-root group and one reduce-scatter per group; HSDP adds one
all-reduce per group.  torch's own ``fully_shard`` is counted the same way.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from tests.support.dist import run_on_ranks
from tests.support.models import lm_loss
from tests.support.runtime_common import ARGS, local_batch, seeded_transformer
from tests.support.runtime_scenarios import make_mesh, per_block, shardkit_api, torch_api

LAYERS = ARGS.n_layers


_NAMES = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter", "allreduce_": "all_reduce"}


def _short(counts) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, n in counts.items():
        name = next((short for key, short in _NAMES.items() if key in str(op)), str(op))
        out[name] = out.get(name, 0) + n
    return out


def _count_per_step(impl: str, shape, micro_sync=(True,), root_reshard=None):
    api = shardkit_api() if impl == "shardkit" else torch_api()
    mesh = make_mesh(shape)
    model = seeded_transformer()
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh)
    api.fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    for step in range(2):
        passes = []
        for micro, sync in enumerate(micro_sync):
            model.set_requires_gradient_sync(sync)
            tokens, targets = local_batch(step, dist.get_world_size(), dist.get_rank(), micro=micro)
            with CommDebugMode() as forward:
                loss = lm_loss(model(tokens), targets)
            with CommDebugMode() as backward:
                loss.backward()
            passes.append({"forward": _short(forward.get_comm_counts()),
                           "backward": _short(backward.get_comm_counts())})
        opt.step()
        opt.zero_grad()
        steps.append(passes)
    return steps


def test_per_block_full_shard_issues_one_all_gather_and_one_reduce_scatter_per_group():
    for impl in ("shardkit", "torch"):
        for steps in run_on_ranks(2, _count_per_step, impl, (2,)):
            for (one_pass,) in steps:
                assert one_pass["forward"] == {"all_gather": LAYERS + 1}, (impl, one_pass)
                assert one_pass["backward"] == {"all_gather": LAYERS, "reduce_scatter": LAYERS + 1}, (impl, one_pass)


def test_resharding_root_adds_its_backward_all_gather():
    for steps in run_on_ranks(2, _count_per_step, "shardkit", (2,), (True,), True):
        for (one_pass,) in steps:
            assert one_pass["backward"] == {"all_gather": LAYERS + 1, "reduce_scatter": LAYERS + 1}


def test_hsdp_adds_one_all_reduce_per_group_and_no_sync_skips_all_reduction():
    for impl in ("shardkit", "torch"):
        for steps in run_on_ranks(4, _count_per_step, impl, (2, 2), (False, True)):
            for unsynced, synced in steps:
                assert unsynced["backward"] == {"all_gather": LAYERS}, (impl, unsynced)
                assert synced["backward"] == {"all_gather": LAYERS, "reduce_scatter": LAYERS + 1,
                                              "all_reduce": LAYERS + 1}, (impl, synced)


@contextlib.contextmanager
def _recording(log: list):
    """Log every all-gather issued and every reduction, with the group's module."""
    from shardkit.runtime.param_group import ParamGroup

    orig_unshard, orig_reduce = ParamGroup.unshard, ParamGroup._reduce

    def unshard(self, *args, **kwargs):
        fresh = self._pending is None and not self.is_unsharded
        orig_unshard(self, *args, **kwargs)
        if fresh and (self._pending is not None or self.is_unsharded):
            log.append(("all_gather", self.fqn, self.training_state.name))

    def reduce(self, *args, **kwargs):
        log.append(("reduce_scatter", self.fqn))
        return orig_reduce(self, *args, **kwargs)

    ParamGroup.unshard, ParamGroup._reduce = unshard, reduce
    try:
        yield
    finally:
        ParamGroup.unshard, ParamGroup._reduce = orig_unshard, orig_reduce


def _event_order(explicit_forward_prefetch: bool, no_backward_prefetch: bool = False):
    model = per_block(seeded_transformer(), shardkit_api(), make_mesh((dist.get_world_size(),)))
    layers = list(model.layers)
    log: list = []
    for i, layer in enumerate(layers):
        layer.attention_norm.register_forward_pre_hook(lambda m, a, i=i: log.append(("compute", f"layers.{i}")))
        if explicit_forward_prefetch:
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 2])
    if no_backward_prefetch:
        for module in [model, *layers]:
            module.set_modules_to_backward_prefetch([])
    tokens, targets = local_batch(0, dist.get_world_size(), dist.get_rank())
    with _recording(log):
        loss = lm_loss(model(tokens), targets)
        forward = list(log)
        log.clear()
        loss.backward()
    return forward, log


def test_backward_prefetches_the_previous_block_and_reduces_in_reverse_order():
    forward, backward = run_on_ranks(2, _event_order, False)[0]
    assert forward == [
        ("all_gather", "<root>", "FORWARD"),
        ("all_gather", "layers.0", "FORWARD"), ("compute", "layers.0"),
        ("all_gather", "layers.1", "FORWARD"), ("compute", "layers.1"),
        ("all_gather", "layers.2", "FORWARD"), ("compute", "layers.2"),
    ]
    assert backward == [
        ("all_gather", "layers.2", "PRE_BACKWARD"),  # prefetched by the root's pre-backward
        ("all_gather", "layers.1", "PRE_BACKWARD"),  # prefetched by layers.2's pre-backward
        ("reduce_scatter", "layers.2"),
        ("all_gather", "layers.0", "PRE_BACKWARD"),
        ("reduce_scatter", "layers.1"),
        ("reduce_scatter", "layers.0"),
        ("reduce_scatter", "<root>"),  # the embedding's inputs need no grad: the final callback
    ]


def test_empty_backward_prefetch_list_gathers_each_block_only_at_its_own_pre_backward():
    _, backward = run_on_ranks(2, _event_order, False, True)[0]
    assert backward == [
        ("all_gather", "layers.2", "PRE_BACKWARD"),  # the root's pre-backward prefetches nothing
        ("reduce_scatter", "layers.2"),
        ("all_gather", "layers.1", "PRE_BACKWARD"),
        ("reduce_scatter", "layers.1"),
        ("all_gather", "layers.0", "PRE_BACKWARD"),
        ("reduce_scatter", "layers.0"),
        ("reduce_scatter", "<root>"),
    ]


def test_explicit_forward_prefetch_gathers_the_next_block_before_this_one_computes():
    forward, _ = run_on_ranks(2, _event_order, True)[0]
    assert forward == [
        ("all_gather", "<root>", "FORWARD"),
        ("all_gather", "layers.0", "FORWARD"), ("all_gather", "layers.1", "FORWARD"), ("compute", "layers.0"),
        ("all_gather", "layers.2", "FORWARD"), ("compute", "layers.1"),
        ("compute", "layers.2"),
    ]


def _forward_gathers_after_backward_without_reshard():
    model = per_block(seeded_transformer(), shardkit_api(), make_mesh((dist.get_world_size(),)))
    counts = []
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)
        model.set_reshard_after_backward(micro == 1)  # keep everything unsharded after the first backward
        tokens, targets = local_batch(0, dist.get_world_size(), dist.get_rank(), micro=micro)
        with CommDebugMode() as forward:
            loss = lm_loss(model(tokens), targets)
        loss.backward()
        counts.append(_short(forward.get_comm_counts()))
    return counts


def test_keeping_params_after_backward_saves_the_next_forward_all_gathers():
    for first, second in run_on_ranks(2, _forward_gathers_after_backward_without_reshard):
        assert first == {"all_gather": LAYERS + 1}
        assert second == {}  # every group is still unsharded from the previous backward
