"""The short fault soak (``benchmarks/faults.py`` runs hundreds of cycles): at 4 gloo ranks, one cycle of each
fault -- a rank killed, frozen, raising, out of disk space; the object store throttling, resetting, cutting
answers short, for good and once -- between clean save/load cycles.  No rank hangs, every survivor raises
the named error in time, no committed step is lost and every resumed step loads bitwise."""

from __future__ import annotations

import uuid

import pytest

from tests.support.fault_proxy import FaultProxy
from tests.support.fault_soak import KINDS, S3_RETRIES, plan_cycles, run_soak

pytestmark = pytest.mark.slow
TIMEOUT_S = 5.0  # the checkpoint deadline of the soak's jobs (the deadline tests themselves use 10 s)


def test_a_cycle_of_every_fault_loses_nothing_hangs_nowhere_and_fails_in_time(s3_server, tmp_path):
    import s3fs

    endpoint, options = s3_server
    bucket = f"soak-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    plan = plan_cycles(len(KINDS) + 3, 4, 0.0, seed=7, every_kind_once=True)
    with FaultProxy(endpoint) as proxy:
        proxied = {**options, "client_kwargs": {"endpoint_url": proxy.endpoint},
                   "shardkit": {"retries": S3_RETRIES}}
        report = run_soak(plan, 4, TIMEOUT_S, local_root=str(tmp_path / "root"), s3_root=f"s3://{bucket}/run",
                          s3_options=proxied, proxy=proxy)
    summary = "\n".join(report.lines())
    assert report.cycles == len(plan)
    assert not report.hangs, summary
    assert not report.lost_steps, summary
    assert not report.corrupt_loads, summary
    assert not report.wrong_outcomes, summary
    for kind in ("kill", "stop", "exception", "disk_full"):
        assert report.seconds_to_error[kind] and max(report.seconds_to_error[kind]) <= TIMEOUT_S + 5, summary
    assert report.commits == sum(cycle.commits for cycle in plan), summary  # clean, and the fault retried away
