"""Debug mode: a rank that runs a different collective than its peers is named
at once, instead of a hang until the process-group timeout.  Without it, the
timeout still names the FSDP group and the pass.

The failure every test here provokes: rank 1 skips block 1's forward (a
data-dependent branch gone wrong), so where rank 0 all-gathers ``layers.1``,
rank 1 already all-gathers ``layers.2``.  The blocks are the same size, so
without checks those two all-gathers pair up silently; rank 0's next one,
``layers.2``, then waits for a peer that never comes.  (Per rank, a block
all-gathers 2795 float32 elements: its parameters' padded half rows.)
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tests.support.dist import run_on_ranks
from tests.support.models import Transformer
from tests.support.runtime_common import local_batch, seeded_transformer, shard_blocks_and_root, train_sharded

PG_TIMEOUT_S = 3.0


class _SkipsBlock1OnRank1(Transformer):
    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for i, layer in enumerate(self.layers):
            if i == 1 and dist.get_rank() == 1:
                continue
            h = layer(h)
        return self.output(self.norm(h))


def _forward_with_a_skipped_block(debug: bool):
    """One forward on a mesh over a fresh group with a short timeout; returns what
    this rank raised (or None) and how long it took."""
    import shardkit

    group = dist.new_group(timeout=timedelta(seconds=PG_TIMEOUT_S))
    model = shard_blocks_and_root(seeded_transformer(cls=_SkipsBlock1OnRank1), mesh=DeviceMesh.from_group(group, "cpu"))
    tokens, _ = local_batch(0, 2, dist.get_rank())
    shardkit.set_debug(debug)
    start = time.monotonic()
    try:
        model(tokens)
        raised = None
    except Exception as exc:  # noqa: BLE001 - the test inspects what came out
        raised = (type(exc).__name__, isinstance(exc, shardkit.errors.ShardingError), str(exc))
    finally:
        shardkit.set_debug(None)
    return raised, time.monotonic() - start


def test_debug_mode_raises_collective_mismatch_on_every_rank_naming_both_sides():
    for raised, seconds in run_on_ranks(2, _forward_with_a_skipped_block, True):
        kind, is_sharding_error, message = raised
        assert (kind, is_sharding_error) == ("CollectiveMismatchError", True)
        assert "rank 0: all-gather of group 'layers.1' in forward (2795 x float32)" in message
        assert "rank 1: all-gather of group 'layers.2' in forward (2795 x float32)" in message
        assert "\n" not in message
        assert seconds < 10


def test_without_debug_the_timed_out_collective_names_the_group_and_the_pass():
    (raised, seconds), (peer_raised, _) = run_on_ranks(2, _forward_with_a_skipped_block, False, isolated=True)
    kind, is_sharding_error, message = raised
    assert (kind, is_sharding_error) == ("CollectiveError", True)
    assert message.startswith("all-gather of group 'layers.2' in forward (2795 x float32) over ranks [0, 1] "
                              "failed on rank 0: ")
    assert "Timed out" in message and "SHARDKIT_DEBUG=1" in message and "\n" not in message
    assert PG_TIMEOUT_S <= seconds < PG_TIMEOUT_S + 5
    assert peer_raised is None  # rank 1's all-gathers all found a partner: silently wrong, not stuck


def _train_with_and_without_debug():
    import shardkit

    losses = {}
    for debug in (False, True):
        shardkit.set_debug(debug)
        try:
            model = shard_blocks_and_root(seeded_transformer())
            losses[debug] = train_sharded(model, 3)
        finally:
            shardkit.set_debug(None)
    return losses


def test_debug_mode_leaves_a_correct_run_bitwise_unchanged():
    for losses in run_on_ranks(2, _train_with_and_without_debug):
        assert losses[True] == losses[False]


def test_shardkit_debug_environment_variable_turns_the_checks_on(monkeypatch):
    from shardkit.runtime.debug import debug_enabled, set_debug

    set_debug(None)
    for value, expected in [("1", True), ("yes", True), ("0", False), ("", False)]:
        monkeypatch.setenv("SHARDKIT_DEBUG", value)
        assert debug_enabled() is expected
    set_debug(False)  # the explicit setting wins over the environment
    monkeypatch.setenv("SHARDKIT_DEBUG", "1")
    assert debug_enabled() is False
    set_debug(None)
    assert debug_enabled() is True

