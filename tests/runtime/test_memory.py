"""What each rank holds: exactly its row share, and no unsharded storage
outside the window where a group computes; ``memory_report`` tells the same.

Counts are exact.  A parameter of ``S0`` rows over ``W`` ranks gives rank
``r`` the rows ``torch.chunk`` gives it (``ceil(S0 / W)``, fewer or none on
the last ranks); the shard's storage and the gradient's storage are padded
to ``ceil(S0 / W)`` rows so every rank sends equal sizes; AdamW's states are
exactly the local rows.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.support.dist import run_on_ranks
from tests.support.models import lm_loss
from tests.support.runtime_common import local_batch, seeded_transformer, shard_blocks_and_root


def _rows(size0: int, world: int, rank: int) -> int:
    chunks = torch.chunk(torch.arange(size0), world)
    return chunks[rank].numel() if rank < len(chunks) else 0


def _unique_storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _one_step_counts():
    from shardkit import fully_shard

    model = seeded_transformer()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = local_batch(0, dist.get_world_size(), dist.get_rank())
    lm_loss(model(tokens), targets).backward()
    opt.step()
    params = dict(model.named_parameters())
    return {
        "local_numel": {k: p.to_local().numel() for k, p in params.items()},
        "grad_local_numel": {k: p.grad.to_local().numel() for k, p in params.items()},
        "exp_avg_numel": {k: opt.state[p]["exp_avg"].to_local().numel() for k, p in params.items()},
        "exp_avg_sq_numel": {k: opt.state[p]["exp_avg_sq"].to_local().numel() for k, p in params.items()},
        "param_storage_bytes": _unique_storage_bytes(p.to_local() for p in params.values()),
        "grad_storage_bytes": _unique_storage_bytes(p.grad.to_local() for p in params.values()),
        "state_storage_bytes": _unique_storage_bytes(
            opt.state[p][k].to_local() for p in params.values() for k in ("exp_avg", "exp_avg_sq")),
    }


def test_param_grad_and_adamw_state_hold_exactly_the_row_share_on_three_ranks():
    world = 3
    results = run_on_ranks(world, _one_step_counts)
    shapes = {k: p.shape for k, p in seeded_transformer().named_parameters()}
    for rank, out in enumerate(results):
        expected = {k: _rows(s[0], world, rank) * math.prod(s[1:]) for k, s in shapes.items()}
        padded = sum(math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes.values())
        assert out["local_numel"] == expected
        assert out["grad_local_numel"] == expected
        assert out["exp_avg_numel"] == expected
        assert out["exp_avg_sq_numel"] == expected
        assert out["param_storage_bytes"] == 4 * padded  # the shard plus its padding rows, nothing else
        assert out["grad_storage_bytes"] == 4 * padded
        assert out["state_storage_bytes"] == 2 * 4 * sum(expected.values())
    # the shares partition the model: nothing duplicated, nothing lost
    total = sum(math.prod(s) for s in shapes.values())
    assert sum(sum(out["local_numel"].values()) for out in results) == total
    # vocab 37 over 3 ranks: 13, 13, 11 rows; pos 16: 6, 6, 4; a rank can also get zero rows
    assert [out["local_numel"]["tok_embeddings.weight"] for out in results] == [13 * 26, 13 * 26, 11 * 26]


def _unsharded_storage_around_a_step(reshard_after_forward):
    from shardkit import fully_shard
    from shardkit.runtime import sharded_params_of

    model = seeded_transformer()
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    params = sharded_params_of(model)

    def snapshot():
        return {
            "unsharded_bytes": sum(p.buffer.untyped_storage().nbytes() for p in params if p.buffer is not None),
            "registered_dtensors": all(isinstance(getattr(p.info.module, p.info.name), DTensor) for p in params),
            "post_forward_slice_numel": sum(p.post_forward_data.numel() for p in params
                                            if p.post_forward_data is not None),
        }

    full_bytes = sum(dist.get_world_size() * p.padded_numel * 4 for p in params)
    tokens, targets = local_batch(0, dist.get_world_size(), dist.get_rank())
    before = snapshot()
    loss = lm_loss(model(tokens), targets)
    after_forward = snapshot()
    loss.backward()
    after_backward = snapshot()
    return {"before": before, "after_forward": after_forward, "after_backward": after_backward,
            "full_bytes": full_bytes, "full_numel": full_bytes // 4}


def test_resharding_forward_and_backward_leave_no_unsharded_storage():
    for out in run_on_ranks(2, _unsharded_storage_around_a_step, True):
        for moment in ("before", "after_forward", "after_backward"):
            assert out[moment]["unsharded_bytes"] == 0, (moment, out[moment])
            assert out[moment]["registered_dtensors"], moment
            assert out[moment]["post_forward_slice_numel"] == 0


def test_reshard_after_forward_false_keeps_unsharded_params_until_backward():
    for out in run_on_ranks(2, _unsharded_storage_around_a_step, False):
        assert out["before"]["unsharded_bytes"] == 0
        assert out["after_forward"]["unsharded_bytes"] == out["full_bytes"]
        assert not out["after_forward"]["registered_dtensors"]  # the plain unsharded views are registered
        assert out["after_backward"]["unsharded_bytes"] == 0
        assert out["after_backward"]["registered_dtensors"]


def test_reshard_after_forward_two_keeps_half_the_full_parameters_on_four_ranks():
    for out in run_on_ranks(4, _unsharded_storage_around_a_step, 2):
        assert out["after_forward"]["unsharded_bytes"] == 0
        assert out["after_forward"]["registered_dtensors"]
        # each rank keeps 1/2 of every padded full tensor: twice its 1/4 shard
        assert out["after_forward"]["post_forward_slice_numel"] == out["full_numel"] // 2
        assert out["after_backward"]["post_forward_slice_numel"] == 0
        assert out["after_backward"]["unsharded_bytes"] == 0


def _live_unsharded_bytes_at_each_unshard():
    from shardkit import fully_shard
    from shardkit.runtime import param_groups_of, sharded_params_of
    from shardkit.runtime.param_group import ParamGroup

    model = seeded_transformer()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    params = sharded_params_of(model)
    samples: list[tuple[str, int]] = []
    original = ParamGroup.wait_for_unshard

    def sampled(self):
        original(self)
        live = sum(p.buffer.untyped_storage().nbytes() for p in params if p.buffer is not None)
        samples.append((self.training_state.name, live))

    ParamGroup.wait_for_unshard = sampled
    try:
        tokens, targets = local_batch(0, dist.get_world_size(), dist.get_rank())
        lm_loss(model(tokens), targets).backward()
    finally:
        ParamGroup.wait_for_unshard = original
    world = dist.get_world_size()

    def group_bytes(group):
        return sum(world * p.padded_numel * 4 for p in group.params)

    return {"samples": samples, "root": group_bytes(param_groups_of(model)[0]),
            "block": group_bytes(param_groups_of(model.layers[0])[0])}


def test_at_most_one_block_in_forward_and_two_in_backward_are_unsharded_besides_the_root():
    for out in run_on_ranks(2, _live_unsharded_bytes_at_each_unshard):
        forward = [b for state, b in out["samples"] if state == "FORWARD"]
        backward = [b for state, b in out["samples"] if state == "PRE_BACKWARD"]
        assert max(forward) == out["root"] + out["block"]
        # the block being differentiated plus the one prefetched for next
        assert max(backward) == out["root"] + 2 * out["block"]


def _memory_reports_around_a_step():
    import shardkit

    model = shard_blocks_and_root(seeded_transformer())
    reports = {"at rest": shardkit.memory_report(model)}

    def inside_block_1(module, args):  # a plain submodule's hook: its block is unsharded now
        reports["in layers.1's forward"] = shardkit.memory_report(model)

    model.layers[1].attention.register_forward_pre_hook(inside_block_1)
    tokens, targets = local_batch(0, dist.get_world_size(), dist.get_rank())
    lm_loss(model(tokens), targets).backward()
    reports["after backward"] = shardkit.memory_report(model)
    return {moment: {"groups": [(g.fqn, g.params, g.sharded_bytes, g.unsharded_bytes,
                                 g.unsharded_allocated_bytes, g.gradient_bytes) for g in report.groups],
                     "unsharded": report.unsharded, "table": str(report)}
            for moment, report in reports.items()}


def test_memory_report_gives_each_groups_bytes_and_what_is_unsharded_now():
    # per rank of 2: a block's padded shard is 2795 fp32 elements, the root's 1222
    block, root = 2795 * 4, 1222 * 4
    for rank, out in enumerate(run_on_ranks(2, _memory_reports_around_a_step)):
        rest, inside, after = out["at rest"], out["in layers.1's forward"], out["after backward"]
        assert rest["groups"] == [("", 5, root, 2 * root, 0, 0)] + [
            (f"layers.{i}", 13, block, 2 * block, 0, 0) for i in range(3)]
        assert rest["unsharded"] == []
        assert inside["unsharded"] == ["", "layers.1"]  # the root keeps its parameters until backward
        assert [g[4] for g in inside["groups"]] == [2 * root, 0, 2 * block, 0]
        assert after["unsharded"] == []
        # the reduced gradients: this rank's real rows (rank 1 holds 25 of w1's 51 rows, 18 of vocab 37)
        assert [g[5] for g in after["groups"]] == ([root, block, block, block] if rank == 0 else
                                                   [root - 4 * 2 * 26, block - 4 * 27, block - 4 * 27,
                                                    block - 4 * 27])
        assert "unsharded now: <root>, layers.1" in inside["table"]
