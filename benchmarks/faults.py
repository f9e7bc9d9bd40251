"""Fault soak: save/load cycles at 4 gloo ranks with a fault in a share of them, then the exit soak.

    python benchmarks/faults.py                               # 200 cycles, ~30 % faulted, deadline 10 s; 100 exits
    python benchmarks/faults.py --cycles 40 --launches 20     # a shorter run
    python benchmarks/faults.py --seed 3 --fault-share 0.5

Each cycle is a fresh 4-rank job (``tests/support/fault_soak.py``): resume the newest committed step of a
``CheckpointManager`` root and check it bitwise, then save the next step.  A drawn cycle carries one fault:
a rank SIGKILLed or SIGSTOPped (before its save or in its first write), a rank raising, a rank whose disk
is full (ENOSPC), or the object store (moto behind the fault proxy) answering data PUTs with 503 SlowDown,
a reset or an answer cut short -- once (the retries absorb it) or for good.  Prints the cycles, faults by
kind, time to error (min/median/max) per kind, hangs, committed steps lost and corrupt loads (each must be
0); then launches a 2-rank module-level training script ``--launches`` times and prints the aborts
(``tests/support/exit_soak.py``).  Exit status 1 when any count that must be 0 is not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads: it must start no thread in the launcher

from tests.support.exit_soak import exit_soak  # noqa: E402 - after the path and thread settings above
from tests.support.fault_proxy import FaultProxy  # noqa: E402
from tests.support.fault_soak import S3_RETRIES, plan_cycles, run_soak  # noqa: E402
from tests.support.s3_server import moto_server  # noqa: E402


def _soak(args: argparse.Namespace, work: Path) -> bool:
    import s3fs

    plan = plan_cycles(args.cycles, args.ranks, args.fault_share, args.seed)
    with moto_server() as (endpoint, options), FaultProxy(endpoint) as proxy:
        bucket = f"soak-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**options).mkdir(bucket)
        proxied = {**options, "client_kwargs": {"endpoint_url": proxy.endpoint}, "shardkit": {"retries": S3_RETRIES}}

        def progress(cycle, outcomes) -> None:
            ok = sum(1 for o in outcomes.values() if o and o["ok"])
            print(f"  cycle {cycle.number:>4}: {cycle.kind or '-':<10} rank {cycle.target} {cycle.moment:<6} "
                  f"{'transient' if cycle.transient else '':<9} {ok}/{len(outcomes)} ranks saved", flush=True)

        started = time.perf_counter()
        report = run_soak(plan, args.ranks, args.timeout, local_root=str(work / "root"), s3_root=f"s3://{bucket}/run",
                          s3_options=proxied, proxy=proxy, progress=progress if args.verbose else None)
    seconds = time.perf_counter() - started
    print(f"fault soak: {args.ranks} ranks, deadline {args.timeout:g} s, S3 retries {S3_RETRIES}, seed {args.seed}, "
          f"{seconds:.0f} s")
    for line in report.lines():
        print(line)
    return not (report.hangs or report.lost_steps or report.corrupt_loads or report.wrong_outcomes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--fault-share", type=float, default=0.3, help="share of cycles drawn with a fault")
    parser.add_argument("--timeout", type=float, default=10.0, help="the checkpoint deadline (seconds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--launches", type=int, default=100, help="launches of the exit soak (0: skip it)")
    parser.add_argument("--verbose", action="store_true", help="one line per cycle")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="shardkit-faults-"))
    # the exit soak first: it forks this process, which must not have started a thread yet (the fault soak's
    # servers and storage clients start some); no ``with`` or ``finally`` around it: the forked ranks leave
    # through these frames (see tests/support/exit_soak.py)
    exits_good = True
    if args.launches:
        started = time.perf_counter()
        report = exit_soak(args.launches, 4, work / "exits", [])
        exits = (f"exit soak: {report['launches']} launches of 2 ranks in {time.perf_counter() - started:.0f} s; "
                 f"exit codes {report['exit_codes']}; aborts (SIGABRT): {report['aborts']}; 'terminate called': "
                 f"{report['terminate_called']}")
        exits_good = not report["failed"] and not report["aborts"]
    good = _soak(args, work)
    if args.launches:
        print(exits)
    shutil.rmtree(work, ignore_errors=True)
    good = good and exits_good
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
