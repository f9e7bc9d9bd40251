"""The multi-rank harness itself: torchrun-like ranks, fast failures, no orphans."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import PG_TIMEOUT_S, RankFailure, recycle_crowded_pools, run_on_ranks


def _identity_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")},
        "sum": t.item(),
        "pid": os.getpid(),
    }


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one says no")
    dist.barrier()


MISMATCH_TIMEOUT_S = 4.0  # the collective's own timeout: the harness must report within seconds of it


def _mismatched_collective():
    from datetime import timedelta

    group = dist.new_group(timeout=timedelta(seconds=MISMATCH_TIMEOUT_S))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.zeros(3), group=group)
    else:
        dist.barrier(group=group)
        dist.barrier(group=group)


def _pid():
    return os.getpid()


def test_ranks_see_torchrun_environment_and_a_gloo_group():
    out = run_on_ranks(3, _identity_and_sum)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["backend"] == "gloo" and o["sum"] == 6.0 for o in out)
    assert [o["env"]["RANK"] for o in out] == ["0", "1", "2"]
    assert all(o["env"]["MASTER_ADDR"] == "127.0.0.1" for o in out)


def test_an_exception_on_one_rank_fails_with_its_traceback_and_kills_the_pool():
    pids = run_on_ranks(2, _pid)
    with pytest.raises(RankFailure, match="rank one says no") as info:
        run_on_ranks(2, _raise_on_rank_one)
    assert "--- rank 1 ---" in str(info.value)
    time.sleep(0.5)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # the next call gets a fresh, working group
    assert run_on_ranks(2, _identity_and_sum)[1]["sum"] == 3.0


def test_a_mismatched_collective_fails_in_seconds_not_minutes():
    start = time.monotonic()
    with pytest.raises(RankFailure):
        run_on_ranks(2, _mismatched_collective, timeout=PG_TIMEOUT_S + 30)
    assert time.monotonic() - start < MISMATCH_TIMEOUT_S + 15


def test_isolated_ranks_are_started_for_one_call_and_stopped_after_it():
    pooled = run_on_ranks(2, _pid)
    isolated = run_on_ranks(2, _pid, isolated=True)
    assert not set(isolated) & set(pooled)
    time.sleep(0.5)
    for pid in isolated:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert run_on_ranks(2, _pid) == pooled  # the pool is untouched


def _form_groups(count: int) -> int:
    for _ in range(count):
        dist.new_group()
    return len(os.listdir("/proc/self/task"))


def test_a_pool_crowded_with_process_groups_is_replaced_between_tests_and_a_quiet_one_kept():
    pooled = run_on_ranks(2, _pid)
    threads = run_on_ranks(2, _form_groups, 4)[0]
    recycle_crowded_pools(max_threads=threads + 4)
    assert run_on_ranks(2, _pid) == pooled  # under the limit: the same ranks
    recycle_crowded_pools(max_threads=threads - 4)
    fresh = run_on_ranks(2, _pid)
    assert not set(fresh) & set(pooled)
    time.sleep(0.5)
    for pid in pooled:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
