"""Exit soak: launch a 2-rank training script with everything at module level 100 times; count the aborts.

    python benchmarks/exit_soak.py                       # 100 launches, 4 at once, thread writer
    python benchmarks/exit_soak.py --launches 30 --bare  # end without manager.wait() / destroy_process_group()
    python benchmarks/exit_soak.py --writer process      # the default writer of async saves (slower to start)

Each launch runs ``tests/support/exit_module_level_run.py`` (model, optimizer and
``CheckpointManager(async_save=True, local=...)`` as module globals, two steps,
each saved in the background) on two gloo ranks forked with torchrun's
environment (``tests/support/exit_soak.py`` says why not torchrun itself), and
records how each rank left.  An exit-time abort shows as SIGABRT and
"terminate called without an active exception" in the rank's output; the
target is 0 of 100.  Prints one line per count and, with ``--json``, the
report.  Exit status 1 if any rank failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads: it must start no thread in the launcher

from tests.support.exit_soak import exit_soak  # noqa: E402 - after the path and thread settings above


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--at-once", type=int, default=4, help="launches running together (they load each other)")
    parser.add_argument("--out", default=None, help="where the launches write (default: a temporary directory)")
    parser.add_argument("--bare", action="store_true", help="the script ends right after its last save")
    parser.add_argument("--writer", choices=["thread", "process"], default="thread")
    parser.add_argument("--json", action="store_true", help="also print the report as JSON")
    args = parser.parse_args(argv)
    # no ``with`` or ``finally`` around the soak: each forked rank leaves through these frames, and would
    # run them (a TemporaryDirectory would be removed under the running launches)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="shardkit-exit-soak-"))
    started = time.perf_counter()
    report = exit_soak(args.launches, args.at_once, out, ["--writer", args.writer, *(["--bare"] if args.bare else [])])
    seconds = time.perf_counter() - started
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    print(f"launches: {report['launches']} ({report['ranks']} ranks, {args.at_once} at once, writer "
          f"{args.writer}{', bare' if args.bare else ''}) in {seconds:.0f} s")
    print(f"exit codes: {report['exit_codes']}")
    print(f"aborts (SIGABRT): {report['aborts']}")
    print(f"'terminate called' in a rank's output: {report['terminate_called']}")
    print(f"last step committed: {report['last_step_committed']} of {report['launches']}")
    for entry in report["failed"][:3]:
        print(f"-- launch {entry['launch']} rank {entry['rank']} exited {entry['code']}:\n{entry['log'][-1000:]}")
    if args.json:
        print(json.dumps(report))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
