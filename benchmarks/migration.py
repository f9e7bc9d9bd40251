"""Cloud migration: ``shardkit reshard`` and ``shardkit convert`` between S3 buckets vs a plain parallel copy.

A local moto S3 server (``tests/support/s3_server.py``, started here as the suite starts it) holds a shardkit
checkpoint at ``s3://src-…/ckpt`` (the LLaMA-shaped MLP stack of :mod:`peers_systems`, fp32 + AdamW, saved
by one process; its size from ``--sizes``).  Per size, in two settings -- ``direct`` (the clients talk to
moto) and ``+20ms`` (through the fault proxy of ``tests/support/fault_proxy.py``, which adds ``--latency`` s
before every request it forwards) -- and ``--rounds`` rounds, each op timed as a user runs it (a fresh
process, wall time), the first three in an order that rotates from round to round:

* ``reshard``: ``shardkit reshard s3://src/ckpt s3://dst/… --world-size 3 --workers N``;
* ``convert``: ``shardkit convert s3://src/ckpt s3://dst/… --to shardkit --workers N``;
* ``copy``: a plain parallel copy of the same objects to the other bucket through s3fs (this file, run as
  ``--copy-worker``): every object read in ranged GETs of ``--part`` bytes (8 MiB) and written back as a
  multipart upload of those parts (one PUT for a smaller object), ``N`` requests in flight at most, each
  part held in memory only while it travels;
* ``rerun``: the reshard started again into a fresh prefix, killed (SIGKILL, its whole session) once its
  first data file is journaled (the prefix listed every 50 ms, directly on moto), then rerun to
  completion: the rerun's time (the report says how many files each kill left finished).

Every output is loaded back in this process into full tensors (a resharding load of the 3-rank output) and
compared with the source, per tensor (float64 sums, exactly); outputs are removed after each op.  Through
the proxy the requests each op makes are counted by method, and those carrying >= 1 MiB (the data) with
their mean size (the rerun's GETs say whether it re-read what was already written).  Target: ``reshard``
and ``convert`` <= 1.2x the ``copy`` in both settings.

``--baseline DIR`` also runs ``reshard`` and ``convert`` from another checkout of shardkit (e.g. ``git archive
<commit> | tar -x -C DIR``), as ``reshard@base`` and ``convert@base`` in the same rotation, so that a change is
measured before and after in one run, against the same copy (``--no-rerun`` leaves the rerun out).

Where the time goes: every round also times, alone, what each process pays before its first request
(the interpreter, ``import s3fs``, ``import torch``, ``shardkit --help``); the ``moving`` column is each
op's time less its process's start-up over the copy's likewise -- the pace of the pipeline itself.

    python benchmarks/migration.py                              # 500MB, 3 rounds
    python benchmarks/migration.py --sizes 5MB --rounds 1       # smoke run
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
import checkpoint_targets as targets  # noqa: E402 - beside this file

LIMIT = 1.2
# what a process pays before its first request, timed alone in every round (fresh processes, like the ops)
STARTUPS = {"python": ["-c", "pass"], "import s3fs": ["-c", "import s3fs"], "import torch": ["-c", "import torch"],
            "shardkit --help": ["-m", "shardkit", "--help"]}
DATA_REQUEST = 1 << 20  # a request carrying at least this many bytes moves data (the rest: metadata, headers)
OPS = ("reshard", "convert", "copy")


# -- the plain parallel copy (its own process) -----------------------------------------------------------------


def copy_objects(src: str, dst: str, options: dict[str, Any], workers: int, part: int) -> int:
    """Copy every object under ``src`` to ``dst`` (``bucket/prefix`` each) through the client; bytes copied."""
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    found = fs.find(src, detail=True)
    uploads: dict[str, tuple[str, str, list]] = {}  # source path -> (bucket, key, parts)
    jobs = []
    for path, info in found.items():
        target = dst.rstrip("/") + path[len(src.rstrip("/")):]
        bucket, key = target.split("/", 1)
        if info["size"] <= part:
            jobs.append((path, target, None, 0, info["size"]))
            continue
        upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        uploads[path] = (bucket, key, [None] * -(-info["size"] // part))
        for n, start in enumerate(range(0, info["size"], part)):
            jobs.append((path, target, upload["UploadId"], n, min(start + part, info["size"])))

    def run(job: tuple) -> None:
        path, target, upload_id, n, end = job
        if upload_id is None:
            fs.pipe_file(target, fs.cat_file(path))
            return
        bucket, key, parts = uploads[path]
        body = fs.cat_file(path, start=n * part, end=end)
        answer = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n + 1, Body=body)
        parts[n] = {"ETag": answer["ETag"], "PartNumber": n + 1}

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(run, jobs))
    for path, (bucket, key, parts) in uploads.items():
        upload_id = next(j[2] for j in jobs if j[0] == path and j[2])
        fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                   MultipartUpload={"Parts": parts})
    return sum(info["size"] for info in found.values())


# -- the driver ----------------------------------------------------------------------------------------------------


def cli(*words: str, endpoint: str) -> list[str]:
    return [sys.executable, "-m", "shardkit", *words, "--storage-option", f"client_kwargs.endpoint_url={endpoint}"]


def baseline_env(checkout: str) -> dict[str, str]:
    """The environment that runs ``python -m shardkit`` from ``checkout`` (its ``cli/`` folder is the
    ``shardkit.cli`` package, as the editable install maps it: linked into place once)."""
    link = os.path.join(checkout, "shardkit", "cli")
    if not os.path.exists(link):
        os.symlink(os.path.join(checkout, "cli"), link)
    return {**os.environ, "PYTHONPATH": checkout}


def timed(command: list[str], cwd: str = REPO, env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:5])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def interrupt(command: list[str], fs: Any, dst: str) -> str | None:
    """Start ``command`` and SIGKILL it (its whole session) once its first data file is journaled under
    ``dst`` (listed every 50 ms, directly on moto): the files finished by then are what a rerun must keep
    without reading them back.  ``None`` when it committed before it could be killed."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                            start_new_session=True)
    deadline = time.monotonic() + 900
    journal = f"{dst}/.shardkit-resume"
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            done = [p for p in fs.ls(journal, refresh=True) if p.endswith(".json")]
        except FileNotFoundError:
            done = []
        if done:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            fs.invalidate_cache(dst)
            if fs.exists(f"{dst}/manifest.json"):  # it committed after the listing, before the kill (its journal
                return None                        # is removed after the manifest is written)
            try:
                finished = len([p for p in fs.ls(journal, refresh=True) if p.endswith(".json")])
            except FileNotFoundError:  # it committed (and removed its journal) between the listing and the kill
                return None if fs.exists(f"{dst}/manifest.json") else "killed with its journal gone"
            return f"killed with {finished} data file(s) of 3 journaled"
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return None if fs.exists(f"{dst}/manifest.json") else "killed at the deadline"


def check(url: str, options: dict[str, Any], sums: dict[str, float], shapes_from: Any, what: str) -> None:
    """Load ``url`` into full tensors in this process and compare them with the source's sums, exactly."""
    import shardkit.checkpoint as skc

    state = skc.get_training_state(*shapes_from())
    for t in _tensors(state).values():
        t.zero_()
    skc.load(state, url, storage_options=options)
    got = {k: float(t.double().sum()) for k, t in _tensors(state).items()}
    if got != sums:
        bad = [k for k in sums if got.get(k) != sums[k]]
        raise SystemExit(f"{what}: the output at {url} holds other values, e.g. {bad[:3]}")


def _tensors(state: Any) -> dict[str, Any]:
    import peers_systems as ps

    return ps.tensors(state)


def one_size(args: argparse.Namespace, size: float) -> dict[str, Any]:
    import peers_systems as ps
    import s3fs

    import shardkit.checkpoint as skc
    from tests.support.fault_proxy import FaultProxy
    from tests.support.s3_server import moto_server

    def model() -> Any:
        return ps.build(size, None)

    out: dict[str, Any] = {"times": collections.defaultdict(list), "requests": {}, "data_requests": {},
                           "startups": collections.defaultdict(list)}
    with moto_server() as (endpoint, options), FaultProxy(endpoint) as proxy:
        fs = s3fs.S3FileSystem(**options)
        src_bucket, dst_bucket = f"src-{uuid.uuid4().hex[:8]}", f"dst-{uuid.uuid4().hex[:8]}"
        fs.mkdir(src_bucket)
        fs.mkdir(dst_bucket)
        state = skc.get_training_state(*model())
        sums = {k: float(t.double().sum()) for k, t in _tensors(state).items()}
        skc.save(state, f"s3://{src_bucket}/ckpt", storage_options=options)
        del state
        out["bytes"] = fs.du(f"{src_bucket}/ckpt")
        out["objects"] = len(fs.find(f"{src_bucket}/ckpt"))
        for setting in ("direct", f"+{args.latency * 1e3:g}ms"):
            via = endpoint if setting == "direct" else proxy.endpoint
            if setting != "direct":
                proxy.add("latency", times=None, delay=args.latency)
            via_options = {**options, "client_kwargs": {"endpoint_url": via}}
            ops = OPS + (("reshard@base", "convert@base") if args.baseline else ())
            for r in range(args.rounds):
                turn = r % len(ops)
                for op in ops[turn:] + ops[:turn] + (() if args.no_rerun else ("rerun",)):
                    dst = f"{dst_bucket}/{op}-{setting}-{r}"
                    seen = len(proxy.requests)
                    src_url, dst_url = f"s3://{src_bucket}/ckpt", f"s3://{dst}"
                    if op == "copy":
                        seconds = timed([sys.executable, os.path.abspath(__file__), "--copy-worker", src_url, dst_url,
                                         "--endpoint", via, "--workers", str(args.workers), "--part", str(args.part)])
                    elif op == "rerun":
                        command = cli("reshard", src_url, dst_url, "--world-size", "3", "--workers",
                                      str(args.workers), endpoint=via)
                        note = interrupt(command, fs, dst)
                        out.setdefault("rerun_notes", []).append(
                            f"{setting}, round {r + 1}: {note or 'committed before it could be killed: no rerun'}")
                        if note is None:
                            fs.rm(dst, recursive=True)
                            continue
                        seen = len(proxy.requests)
                        seconds = timed(command)
                    else:
                        name, _, base = op.partition("@")
                        words = ("--world-size", "3") if name == "reshard" else ("--to", "shardkit")
                        command = cli(name, src_url, dst_url, *words, "--workers", str(args.workers), endpoint=via)
                        seconds = timed(command, *((args.baseline, baseline_env(args.baseline)) if base else ()))
                    if setting != "direct":
                        counts = collections.Counter(q.method for q in proxy.requests[seen:])
                        out["requests"][f"{op}/{setting}"] = dict(counts)
                        data = [q.nbytes for q in proxy.requests[seen:] if q.nbytes >= DATA_REQUEST]
                        out["data_requests"][f"{op}/{setting}"] = (len(data), sum(data))
                    out["times"][f"{op}/{setting}"].append(seconds)
                    check(dst_url, via_options, sums, model, f"{op} ({setting})")
                    fs.rm(dst, recursive=True)
                if setting == "direct":
                    for what, words in STARTUPS.items():
                        out["startups"][what].append(timed([sys.executable, *words]))
                print(f"  {size / 1e6:g} MB, {setting}: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            proxy.clear()
    return out


def startup_account(res: dict[str, Any]) -> tuple[float, float]:
    """(our CLI's start-up, the copy's): the seconds each process spends before its first request, from
    the medians of :data:`STARTUPS` -- the interpreter, then s3fs for both, and ``shardkit --help`` (the
    command's own imports, torch among them) for ours."""
    med = {what: statistics.median(times) for what, times in res["startups"].items()}
    print(f"  start-up, fresh processes (medians): python {med['python']:.2f} s, import s3fs "
          f"{med['import s3fs']:.2f} s, import torch {med['import torch']:.2f} s, 'shardkit --help' "
          f"{med['shardkit --help']:.2f} s")
    return med["shardkit --help"] + med["import s3fs"] - med["python"], med["import s3fs"]


def report(size: str, res: dict[str, Any], args: argparse.Namespace) -> list[targets.Verdict]:
    times = res["times"]
    print(f"\n{size}: a {res['bytes'] / 1e6:.1f} MB shardkit checkpoint in {res['objects']} objects, S3 -> S3 "
          f"(moto on loopback), {args.workers} requests in flight, {args.rounds} rounds, medians (s)")
    ours_start, copy_start = startup_account(res)
    print(f"  'moving' = the time less the process's start-up ({ours_start:.2f} s for the CLI, {copy_start:.2f} s "
          "for the copy): how the pipeline itself compares (for information; the targets count the whole time)")
    settings = sorted({k.split("/", 1)[1] for k in times}, key=lambda s: s != "direct")
    print(f"  {'op':12s} " + " ".join(f"{s:>10s} {'vs copy':>8s} {'moving':>7s}" for s in settings) +
          "   requests through the proxy (by method; those of >= 1 MiB: their mean size)")
    verdicts = []
    for op in (*OPS, "reshard@base", "convert@base", "rerun"):
        if not any(k.startswith(f"{op}/") for k in times):
            continue
        cells, reqs = [], res["requests"].get(f"{op}/{settings[-1]}", {})
        for setting in settings:
            if not times.get(f"{op}/{setting}"):  # every interrupted run committed before its kill
                cells.append(f"{'-':>10s} {'':>8s} {'':>7s}")
                continue
            ours, copy = statistics.median(times[f"{op}/{setting}"]), statistics.median(times[f"copy/{setting}"])
            moving = (ours - (copy_start if op == "copy" else ours_start)) / max(copy - copy_start, 1e-9)
            cells.append(f"{ours:10.2f} {ours / copy:7.2f}x {moving:6.2f}x")
            res.setdefault("medians", {})[f"{op}/{setting}"] = ours
            if op in ("reshard", "convert"):
                verdicts.append(targets.Verdict(f"{size} {op} ({setting}) / plain parallel copy", ours / copy, LIMIT,
                                                f"{ours:.2f} s / {copy:.2f} s"))
        moved, nbytes = res["data_requests"].get(f"{op}/{settings[-1]}", (0, 0))
        sizes = f"; {moved} moved data, {nbytes / max(moved, 1) / 2 ** 20:.1f} MiB each" if moved else ""
        print(f"  {op:12s} " + " ".join(cells) + "   " + ", ".join(f"{m} {n}" for m, n in sorted(reqs.items()))
              + sizes)
    for note in res.get("rerun_notes", []):
        print(f"  interrupted reshard ({note})")
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="500MB", help="checkpoint sizes (weights + AdamW), comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4, help="requests in flight, the CLI's and the copy's")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds added to every proxied request")
    parser.add_argument("--part", type=int, default=8 << 20, help="the copy's request size (bytes)")
    parser.add_argument("--json", default=None, help="also keep the raw results here")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="also run reshard and convert from this checkout of shardkit (before/after)")
    parser.add_argument("--no-rerun", action="store_true", help="leave out the interrupted reshard's rerun")
    parser.add_argument("--copy-worker", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.copy_worker:
        from tests.support.s3_server import s3_options

        src, dst = (u.removeprefix("s3://") for u in args.copy_worker)
        copy_objects(src, dst, s3_options(args.endpoint), args.workers, args.part)
        return
    import peers_systems as ps

    targets.judge_sizes(args.sizes, lambda size: one_size(args, ps.parse_size(size)),
                        lambda size, res: report(size, res, args), args.rounds, args.json)


if __name__ == "__main__":
    main()
