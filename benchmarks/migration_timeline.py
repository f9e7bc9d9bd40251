"""Where a migration's seconds go: one S3 -> S3 ``reshard``/``convert``/copy process, its requests on a clock.

``benchmarks/migration.py`` says how long each op takes; this says *when* each
process starts moving bytes.  A local moto server holds the same checkpoint
(:mod:`peers_systems`'s model, fp32 + AdamW, ``--size``); each op runs in a
fresh process, as a user runs it, under a probe (this file, ``--probe``) that
stamps, on the machine's monotonic clock (``time.perf_counter``, the same in
every process), every request the s3fs client makes (method, key, start, end,
bytes sent), the ``import torch`` (start, end), the head start's begin and the
moment the engine takes its cache over (with the bytes it holds then).  The
driver prints, per op, the medians over ``--rounds`` of these milestones,
counted from the moment the process was launched:

* ``first GET`` / ``first PUT`` (data only: requests that carry >= 1 MiB, or
  an ``upload_part``/``put_object`` of a data file), ``last PUT end``;
* ``torch`` (the import's start and end), ``takeover`` (the engine's first read
  of the head start's cache, with how many MB it held then);
* ``last request end`` (ours: the commit, then the journal's removal; the
  copy: its last multipart upload completed) and ``exit`` (the process gone,
  as the user's shell sees it).

``--latency S`` sends every request through the fault proxy of
``tests/support/fault_proxy.py``, which adds ``S`` seconds before each.

    python benchmarks/migration_timeline.py --size 200MB --rounds 3
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DATA_REQUEST = 1 << 20
PUTS = ("upload_part", "put_object")
OPS = ("copy", "reshard", "convert")


# -- the probe (inside the measured process) ------------------------------------------------------------------


def probe(out: str, argv: list[str]) -> None:
    """Run ``argv`` (``-m shardkit ...`` or a script) here with its requests, torch import and head start
    stamped; the stamps go to ``out`` (JSON lines) as the process ends."""
    events: list[dict[str, Any]] = []
    lock = threading.Lock()

    def stamp(kind: str, start: float, end: float | None = None, **more: Any) -> None:
        with lock:
            events.append({"kind": kind, "start": start, "end": end if end is not None else start, **more})

    import s3fs

    original_async, original_sync = s3fs.S3FileSystem._call_s3, s3fs.S3FileSystem.call_s3

    async def call_async(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return await original_async(self, method, *args, **kwargs)
        finally:
            stamp("request", t, time.perf_counter(), method=str(getattr(method, "__name__", method)),
                  key=str(kwargs.get("Key", "")), nbytes=_length(kwargs), range=str(kwargs.get("Range", "")))

    def call_sync(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return original_sync(self, method, *args, **kwargs)
        finally:
            stamp("request", t, time.perf_counter(), method=str(method), key=str(kwargs.get("Key", "")),
                  nbytes=_length(kwargs), range="")

    s3fs.S3FileSystem._call_s3 = call_async
    s3fs.S3FileSystem.call_s3 = call_sync
    plain_import = builtins.__import__

    def watched_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name != "torch" or "torch" in sys.modules:
            return plain_import(name, *args, **kwargs)
        t = time.perf_counter()
        try:
            return plain_import(name, *args, **kwargs)
        finally:
            stamp("torch", t, time.perf_counter())

    builtins.__import__ = watched_import

    def dump() -> None:
        with open(out, "w") as f:
            for event in events:
                f.write(json.dumps(event) + "\n")

    if argv[:2] == ["-m", "shardkit"]:
        from shardkit.checkpoint.io import head_start
        from shardkit.cli import main as cli_main

        begin, take = head_start.begin, head_start.take

        def timed_begin(*args: Any, **kwargs: Any) -> bool:
            stamp("head start", time.perf_counter())
            return begin(*args, **kwargs)

        def timed_take(fs: Any) -> Any:
            cache = take(fs)
            stamp("takeover", time.perf_counter(), held=cache.held if cache is not None else 0)
            return cache

        head_start.begin, head_start.take = timed_begin, timed_take
        leave = cli_main.leave_now

        def leave_now(code: int) -> None:
            dump()
            leave(code)

        cli_main.leave_now = leave_now
        sys.argv = ["shardkit", *argv[2:]]
        cli_main.main()
    else:
        import atexit
        import runpy

        atexit.register(dump)
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


def _length(kwargs: dict[str, Any]) -> int:
    body = kwargs.get("Body")
    return len(body) if isinstance(body, (bytes, bytearray, memoryview)) else 0


# -- the driver ---------------------------------------------------------------------------------------------------


def milestones(events: list[dict[str, Any]], launched: float, exited: float) -> dict[str, float]:
    """The milestones of one process, in seconds since its launch (absent ones left out)."""
    def rel(t: float) -> float:
        return round(t - launched, 3)

    requests = [e for e in events if e["kind"] == "request"]
    gets = [e for e in requests if e["method"] == "get_object" and (e["end"] > e["start"])]
    data_gets = [e for e in gets if "manifest" not in e["key"] and not e["key"].endswith(".json")]
    puts = [e for e in requests if e["method"] in PUTS and e["nbytes"] >= DATA_REQUEST]
    out: dict[str, float] = {}
    if data_gets:
        out["first GET"] = rel(min(e["start"] for e in data_gets))
    for kind, name in (("head start", "head start"), ("torch", "torch import start")):
        found = [e for e in events if e["kind"] == kind]
        if found:
            out[name] = rel(found[0]["start"])
    if torch := [e for e in events if e["kind"] == "torch"]:
        out["torch import end"] = rel(torch[0]["end"])
    if takeover := [e for e in events if e["kind"] == "takeover"]:
        out["takeover"] = rel(takeover[0]["start"])
        out["MB held at takeover"] = round(takeover[0]["held"] / 1e6, 1)
    if puts:
        first = min(e["start"] for e in puts)
        out["first PUT"] = rel(first)
        out["MB read before first PUT"] = round(sum(_ranged(e) for e in data_gets if e["end"] <= first) / 1e6, 1)
        out["last PUT end"] = rel(max(e["end"] for e in puts))
    out["last request end"] = rel(max(e["end"] for e in requests))
    out["exit"] = rel(exited)
    return out


def _ranged(event: dict[str, Any]) -> int:
    """The bytes a ranged GET asked for (``bytes=a-b``), 0 when it names no range."""
    text = event["range"].removeprefix("bytes=")
    a, _, b = text.partition("-")
    return int(b) - int(a) + 1 if a.isdigit() and b.isdigit() else 0


def run_probed(argv: list[str], out: str) -> dict[str, float]:
    launched = time.perf_counter()
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", out, "--", *argv], cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    exited = time.perf_counter()
    if done.returncode:
        raise SystemExit(f"{' '.join(argv[:4])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(out) as f:
        events = [json.loads(line) for line in f]
    return milestones(events, launched, exited)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="200MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to every request (proxied)")
    parser.add_argument("--probe", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(args.probe, args.argv)
        return
    sys.path.insert(0, REPO)
    sys.path.insert(0, HERE)
    import peers_systems as ps
    import s3fs

    import shardkit.checkpoint as skc
    from tests.support.fault_proxy import FaultProxy
    from tests.support.s3_server import moto_server

    table: dict[str, list[dict[str, float]]] = {op: [] for op in OPS}
    with moto_server() as (direct, options), FaultProxy(direct) as proxy:
        endpoint = direct
        if args.latency:
            proxy.add("latency", times=None, delay=args.latency)
            endpoint = proxy.endpoint
        fs = s3fs.S3FileSystem(**options)
        src, dst = f"src-{uuid.uuid4().hex[:8]}", f"dst-{uuid.uuid4().hex[:8]}"
        fs.mkdir(src)
        fs.mkdir(dst)
        skc.save(skc.get_training_state(*ps.build(ps.parse_size(args.size), None)), f"s3://{src}/ckpt",
                 storage_options=options)
        stored = fs.du(f"{src}/ckpt")
        scratch = os.path.join("/tmp", f"migration-timeline-{os.getpid()}.jsonl")
        for r in range(args.rounds):
            for op in OPS[r % 3:] + OPS[:r % 3]:
                target = f"s3://{dst}/{op}-{r}"
                if op == "copy":
                    argv = [os.path.join(HERE, "migration.py"), "--copy-worker", f"s3://{src}/ckpt", target,
                            "--endpoint", endpoint, "--workers", str(args.workers)]
                else:
                    words = ("--world-size", "3") if op == "reshard" else ("--to", "shardkit")
                    argv = ["-m", "shardkit", op, f"s3://{src}/ckpt", target, *words, "--workers",
                            str(args.workers), "--storage-option", f"client_kwargs.endpoint_url={endpoint}"]
                table[op].append(run_probed(argv, scratch))
                fs.rm(target.removeprefix("s3://"), recursive=True)
            print(f"  round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        if os.path.exists(scratch):
            os.remove(scratch)
    added = f", +{args.latency * 1e3:g} ms per request" if args.latency else ""
    print(f"{stored / 1e6:.1f} MB S3 -> S3 (moto on loopback{added}), {args.workers} requests in flight, medians of "
          f"{args.rounds} rounds; seconds since the process was launched")
    names = [n for n in ("head start", "first GET", "torch import start", "torch import end", "takeover",
                         "MB held at takeover", "first PUT", "MB read before first PUT", "last PUT end",
                         "last request end", "exit") if any(n in row for rows in table.values() for row in rows)]
    print(f"  {'':26s}" + "".join(f"{op:>10s}" for op in OPS))
    for name in names:
        cells = []
        for op in OPS:
            values = [row[name] for row in table[op] if name in row]
            cells.append(f"{statistics.median(values):10.2f}" if values else f"{'-':>10s}")
        print(f"  {name:26s}" + "".join(cells))


if __name__ == "__main__":
    main()
