"""A warning every rank would print alike is logged by one rank per job, with its caller as its origin."""

from __future__ import annotations

import logging

from shardkit.wire.job_log import log_once_per_job, speaks_for_the_job, warning_once_per_job
from tests.support.dist import run_on_ranks

LOGGER = "shardkit.test_job_log"


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _log_alike_on_every_rank(subgroup_ranks: list[int] | None) -> list[tuple[str, str, str]]:
    import torch.distributed as dist

    logger, kept = logging.getLogger(LOGGER), _Kept()
    logger.addHandler(kept)
    logger.setLevel(logging.DEBUG)
    try:
        group = None if subgroup_ranks is None else dist.new_group(subgroup_ranks, backend="gloo")
        warning_once_per_job(logger, "replicas=%d needs %d nodes", 1, 2, process_group=group)
        log_once_per_job(logger, logging.INFO, "nothing to resume under %s", "ckpt", process_group=group)
        if group is not None:
            dist.destroy_process_group(group)
    finally:
        logger.removeHandler(kept)
    return [(r.levelname, r.getMessage(), r.funcName) for r in kept.records]


def test_without_a_process_group_this_process_logs():
    logger, kept = logging.getLogger(LOGGER), _Kept()
    logger.addHandler(kept)
    try:
        assert speaks_for_the_job()
        assert warning_once_per_job(logger, "only %s", "me") is True
    finally:
        logger.removeHandler(kept)
    [record] = kept.records
    assert (record.levelname, record.getMessage()) == ("WARNING", "only me")
    assert record.funcName == "test_without_a_process_group_this_process_logs"  # the caller, not the helper


def test_on_two_ranks_only_rank_0_logs_and_the_record_names_the_caller():
    per_rank = run_on_ranks(2, _log_alike_on_every_rank, None)
    assert per_rank == [[("WARNING", "replicas=1 needs 2 nodes", "_log_alike_on_every_rank"),
                         ("INFO", "nothing to resume under ckpt", "_log_alike_on_every_rank")], []]


def test_for_a_subgroup_its_own_first_rank_logs_and_ranks_outside_it_do_not():
    per_rank = run_on_ranks(2, _log_alike_on_every_rank, [1])
    assert per_rank == [[], [("WARNING", "replicas=1 needs 2 nodes", "_log_alike_on_every_rank"),
                             ("INFO", "nothing to resume under ckpt", "_log_alike_on_every_rank")]]
