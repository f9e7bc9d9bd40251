"""Arrival at a collective: a waiting rank leaves soon after the last one arrives, and names one that never does."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from shardkit.wire.arrival import arrive, complete, the_group, watched
from tests.support.dist import run_on_ranks

LATE_S = 0.15  # doubling from 0.5 ms left rank 0 here 0.23-0.25 s, a quarter at a time 0.175 s


def _arrive_with_rank_1_late(late_s: float) -> tuple[float, tuple[int, ...]]:
    import torch.distributed as dist

    arrive(None, 30.0)  # both ranks line up first, so the timed wait is rank 1's lateness alone
    if dist.get_rank() == 1:
        time.sleep(late_s)
    start = time.monotonic()
    arrival = arrive(None, 30.0)
    return time.monotonic() - start, arrival.missing


def _arrive_without_rank_1(timeout_s: float) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    import torch.distributed as dist

    arrive(None, 30.0)
    if dist.get_rank() == 1:
        return -1, (), ()
    arrival = arrive(None, timeout_s)
    return arrival.seq, arrival.missing, arrival.behind


def _all_reduce_with_rank_1_late(late_s: float) -> int:
    import threading

    import torch
    import torch.distributed as dist

    seq = arrive(None, 30.0).seq
    if dist.get_rank() == 1:
        time.sleep(late_s)
    original, calls = threading.Event.wait, [0]

    def counted(event: threading.Event, timeout: float | None = None) -> bool:
        calls[0] += 1
        return original(event, timeout)

    threading.Event.wait = counted
    try:
        with watched(the_group(None), seq, 30.0):
            complete(dist.all_reduce(torch.ones(1), async_op=True))
    finally:
        threading.Event.wait = original
    return calls[0]


def test_a_rank_waiting_inside_a_collective_sleeps_until_it_completes_rather_than_spinning_on_the_gil():
    # gloo completes a work's future before work.is_completed() turns true (by up to tens of ms): a wait
    # that looped until then on the already-set event called it thousands of times, under the GIL
    # (about one time in three here); sleeping on the poll schedule through a 0.2 s wait takes about 21
    waits = [run_on_ranks(2, _all_reduce_with_rank_1_late, 0.2) for _ in range(3)]
    assert max(max(counts) for counts in waits) <= 40, waits


def test_a_waiting_rank_leaves_within_a_quarter_of_its_wait_after_the_last_arrives():
    # polls back off by a quarter, so rank 0 oversleeps rank 1's arrival by at most LATE_S / 4 (plus the
    # store's round trip and the scheduler): doubling let it oversleep by up to LATE_S
    waited = [run_on_ranks(2, _arrive_with_rank_1_late, LATE_S)[0] for _ in range(3)]
    assert all(missing == () for _, missing in waited)
    assert min(seconds for seconds, _ in waited) < LATE_S * 1.25 + 0.01, waited


def test_a_rank_that_never_arrives_is_named_with_the_collective_it_last_reached():
    # isolated: rank 1 skips a collective, so the two ranks count them differently from then on
    seq, missing, behind = run_on_ranks(2, _arrive_without_rank_1, 0.3, isolated=True)[0]
    assert (missing, behind) == ((1,), (seq - 1,))


class _CountedStore:
    """The default store, counting the questions a waiting rank asks it about another rank's failure."""

    def __init__(self, store) -> None:
        self.store, self.failure_questions = store, 0

    def check(self, keys):
        self.failure_questions += any(k.endswith("/failed") for k in keys)
        return self.store.check(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


@contextlib.contextmanager
def _counted_store() -> Iterator[_CountedStore]:
    from torch.distributed import distributed_c10d

    counted = _CountedStore(distributed_c10d._get_default_store())
    original, distributed_c10d._get_default_store = distributed_c10d._get_default_store, lambda: counted
    try:
        yield counted
    finally:
        distributed_c10d._get_default_store = original


def _agree_many_times(times: int) -> tuple[int, list[bool]]:
    """``times`` agreements through Dist; (this rank, whether each one's counter is still in the store)."""
    import torch.distributed as dist

    from shardkit.checkpoint.io.dist import Dist
    from shardkit.wire.arrival import group_name

    agreement = Dist(None)
    first = agreement.arrive() + 1  # the arrival before the first agreement
    for _ in range(times):
        agreement.any_failed(False)
    store = dist.distributed_c10d._get_default_store()
    base = f"shardkit/arrive/{group_name(None)}/"
    return dist.get_rank(), [store.check([f"{base}{seq}/n"]) for seq in range(first, first + times)]


def test_rank_0_deletes_a_collectives_keys_inside_the_next_and_the_store_keeps_the_last_ones_only():
    # spent once every rank arrived at the next collective; deleted while rank 0 waits inside that one (its
    # round trips overlap the collective instead of delaying its start)
    rank, held = run_on_ranks(2, _agree_many_times, 12, isolated=True)[0]
    assert rank == 0 and held == [False] * 11 + [True], held


def _all_reduce_with_rank_1_late_counting_questions(late_s: float) -> int:
    import torch
    import torch.distributed as dist

    seq = arrive(None, 30.0).seq
    with _counted_store() as counted:
        if dist.get_rank() == 1:
            time.sleep(late_s)
        with watched(the_group(None), seq, 30.0):
            complete(dist.all_reduce(torch.ones(1), async_op=True))
    return counted.failure_questions


def test_a_short_wait_inside_a_collective_asks_the_store_nothing_about_failures():
    # the first question whether another rank failed comes after 10 ms of waiting: asked from 0.5 ms on, a
    # 4 ms wait cost about six round trips to the store, each as long as the collective with more ranks than
    # cores; a failure is still noticed long before any deadline
    questions = run_on_ranks(2, _all_reduce_with_rank_1_late_counting_questions, 0.004, isolated=True)
    assert questions[0] <= 1, questions
