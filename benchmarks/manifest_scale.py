"""The metadata one loading rank must read, parse and plan from: a synthetic 70B checkpoint at scale (no data).

A LLaMA-3-70B-shaped state -- 723 fp32 parameters (80 layers of dim 8192,
ffn 28672, 8 KV heads; vocabulary 128256), each with AdamW's two moments and
a ``step`` -- is "saved" by FSDP (``Shard(0)``) at ``--save-ranks`` ranks:
every rank writes its row range of every tensor (split at the writer's 64 MiB
chunk cap) into 4 data files, rank 0 the steps.  Only the metadata is made:
the records hold what the native writer would write -- same keys, file
names, offsets, byte counts, checksum blocks (256 KiB) and checksum lists --
and no data file exists.  Each format version is measured in turn: version 1
(every chunk record in ``manifest.json``, what small checkpoints still get)
and version 3, saved as ``save`` saves it: each writer's part
(``summary_of``: check its chunks against its regions, write its index file,
summarise; two writers at a time, each timed, wall and CPU seconds), then rank
0's part alone in a fresh process (``commit_gathered``: decode the gathered
summaries, build, check and commit the manifest; seconds and peak RSS).
Targets: each writer's index at most 1 s, rank 0's commit at most
2 s and 200 MB.

A child process then stands in for one rank (the middle one) of an FSDP job
of ``--load-ranks`` ranks and does what ``load`` does before its first data
read: open the checkpoint (read and validate the metadata -- for version 3,
the manifest and the index files of the writers it needs) and plan the reads
of its row range of every tensor, into meta tensors (so the targets take no
memory).  Reported: the metadata bytes it read (``rchar`` of
``/proc/self/io``), seconds for open + plan, and peak RSS (``VmHWM``) above
the child's RSS before it opened the checkpoint.  Targets: at most 5 MB,
1 s and 200 MB.  Median of ``--reps`` children.

    python benchmarks/manifest_scale.py --save-ranks 1024 --load-ranks 4096
    python benchmarks/manifest_scale.py --save-ranks 64 --load-ranks 256 --reps 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHUNK_CAP = 64 << 20
BLOCK = 256 << 10
FILES_PER_RANK = 4
TOKEN = "5eed5eed5e"


def llama70b_shapes() -> dict[str, tuple[int, ...]]:
    dim, ffn, kv, vocab = 8192, 28672, 1024, 128256
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, dim)}
    for i in range(80):
        p = f"layers.{i}."
        shapes.update({p + "attention.wq.weight": (dim, dim), p + "attention.wk.weight": (kv, dim),
                       p + "attention.wv.weight": (kv, dim), p + "attention.wo.weight": (dim, dim),
                       p + "feed_forward.w1.weight": (ffn, dim), p + "feed_forward.w2.weight": (dim, ffn),
                       p + "feed_forward.w3.weight": (ffn, dim), p + "attention_norm.weight": (dim,),
                       p + "ffn_norm.weight": (dim,)})
    shapes.update({"norm.weight": (dim,), "output.weight": (vocab, dim)})
    return shapes


def state_tensors() -> dict[str, tuple[int, ...]]:
    """Every tensor of the saved state: weights, two moments and a 0-d step per parameter."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in llama70b_shapes().items():
        out[f"model.{name}"] = shape
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"optim.state.{name}.{moment}"] = shape
        out[f"optim.state.{name}.step"] = ()
    return out


def row_range(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """``Shard(0)``'s rows of ``rank`` (torch.chunk: ceil-sized pieces, the last ones short or empty)."""
    per = -(-rows // ranks)
    lo = min(rows, per * rank)
    return lo, min(rows, lo + per) - lo


def pack_crcs(n: int, seed: int) -> str:
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{n}I", *((seed * 2654435761 + i) & 0xFFFFFFFF for i in range(n)))
                            ).decode("ascii")


def rank_files(save_ranks: int, rank: int) -> list[tuple[str, int, list[tuple[str, tuple, tuple, int, int]]]]:
    """What one rank writes: its data files as ``(name, size, [(fqn, offsets, shape, nbytes, start), ...])``."""
    from shardkit.checkpoint.geometry.boxes import split_box

    chunks = []  # (fqn, offsets, shape, nbytes)
    for fqn, shape in state_tensors().items():
        if not shape:
            if rank == 0:
                chunks.append((fqn, (), (), 4))
            continue
        lo, n = row_range(shape[0], save_ranks, rank)
        if n == 0:
            continue
        for offsets, sub in split_box(((lo,) + (0,) * (len(shape) - 1), (n,) + shape[1:]), 4, CHUNK_CAP):
            nbytes = 4
            for s in sub:
                nbytes *= s
            chunks.append((fqn, offsets, sub, nbytes))
    total = sum(c[3] for c in chunks)
    per_file, filled, part, pos = -(-total // FILES_PER_RANK), 0, 0, 0
    files: list = []
    records: list = []
    for fqn, offsets, sub, nbytes in chunks:
        if filled and filled + nbytes > per_file and part < FILES_PER_RANK - 1:
            files.append((f"data/{TOKEN}-{rank}-{part}.safetensors", pos, records))
            part, filled, pos, records = part + 1, 0, 0, []
        if pos == 0:
            pos = 8 + 4096  # the safetensors header (its size does not matter here)
        records.append((fqn, offsets, sub, nbytes, pos))
        pos += nbytes
        filled += nbytes
    if pos:
        files.append((f"data/{TOKEN}-{rank}-{part}.safetensors", pos, records))
    return files


def chunk_json(fqn: str, offsets: tuple, shape: tuple, nbytes: int, start: int, file: str) -> dict:
    """The chunk record the native writer writes for one chunk (checksums made up, one per 256 KiB block)."""
    key = f"{fqn}@{','.join(map(str, offsets))}"
    return {"offsets": list(offsets), "shape": list(shape), "file": file, "key": key, "start": start,
            "nbytes": nbytes, "codec": "raw", "block": BLOCK,
            "crc32c": pack_crcs(max(1, -(-nbytes // BLOCK)), zlib.crc32(key.encode()))}


def make_manifest(save_ranks: int) -> dict:
    """Version 1 (docs/format.md): every chunk a record in the one manifest."""
    tensors = state_tensors()
    records: dict[str, list] = {k: [] for k in tensors}
    files: dict[str, dict] = {}
    for rank in range(save_ranks):
        for name, size, chunks in rank_files(save_ranks, rank):
            files[name] = {"size": size, "writer": rank}
            for fqn, offsets, sub, nbytes, start in chunks:
                records[fqn].append(chunk_json(fqn, offsets, sub, nbytes, start, name))
    return {"format": "shardkit", "version": 1, "meta": {"step": 1000}, "writer": writer_info(save_ranks),
            "tensors": {fqn: {"dtype": "F32", "shape": list(shape), "chunks": records[fqn]}
                        for fqn, shape in tensors.items()},
            "values": {}, "files": files}


def writer_info(save_ranks: int) -> dict:
    return {"world_size": save_ranks, "mesh": {"shape": [save_ranks], "dim_names": ["dp"], "placements": ["S(0)"]}}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def high_water_rss() -> int:
    """Peak RSS of this process's own memory (``VmHWM``; ``ru_maxrss`` would count the parent's pages the
    child had mapped between fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def save_plan(save_ranks: int, rank: int):
    """What ``save`` knows on ``rank`` of an FSDP job (``Shard(0)`` on a 1-D mesh of ``save_ranks``): every
    tensor's dtype and shape, the layout, this rank's coordinate on it and the boxes it stores."""
    from types import SimpleNamespace

    import torch

    tensors = state_tensors()
    layout = {"mesh": {"shape": [save_ranks], "dim_names": ["dp"]}, "placements": ["Shard(dim=0)"],
              "specs": [["shard", 0]], "tensors": [fqn for fqn, shape in tensors.items() if shape]}
    regions = {}
    for fqn, shape in tensors.items():
        if not shape:
            if rank == 0:
                regions[fqn] = [((), ())]
            continue
        lo, n = row_range(shape[0], save_ranks, rank)
        if n:
            regions[fqn] = [((lo,) + (0,) * (len(shape) - 1), (n,) + shape[1:])]
    return SimpleNamespace(tensors={fqn: (torch.float32, shape) for fqn, shape in tensors.items()}, values={},
                           aliases={}, layouts=[layout], coords=[(rank,)], regions=regions,
                           mesh=layout["mesh"] | {"placements": layout["placements"]})


def written_files(save_ranks: int, rank: int) -> list:
    """The records the native writer returns for ``rank``'s data files (``WrittenFile``), as after step 2."""
    from shardkit.checkpoint.formats.crc32c import unpack_crcs
    from shardkit.checkpoint.formats.native.manifest import ChunkRecord
    from shardkit.checkpoint.formats.native.writer import WrittenFile

    out = []
    for name, size, chunks in rank_files(save_ranks, rank):
        records = []
        for fqn, offsets, sub, nbytes, start in chunks:
            c = chunk_json(fqn, offsets, sub, nbytes, start, name)
            crcs = tuple(unpack_crcs(c["crc32c"], max(1, -(-nbytes // BLOCK)), "synthetic"))
            records.append((fqn, ChunkRecord(tuple(offsets), tuple(sub), name, c["key"], start, nbytes, "raw",
                                             BLOCK, crcs)))
        out.append(WrittenFile(name, size, rank, tuple(records)))
    return out


def writer_part(save_ranks: int, root: str, rank: int) -> tuple[float, float, str]:
    """One writer's part of a version-3 save, as ``save`` runs it once its data files are written
    (``summary_of``: check its chunks against its regions, write its index file, summarise); returns its
    wall and CPU seconds and the payload rank 0 gathers from it."""
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.checkpoint.training.rank_report import SummaryReport
    from shardkit.checkpoint.training.save_commit import state_digest, summary_of

    storage = Storage(root)
    plan, files = save_plan(save_ranks, rank), written_files(save_ranks, rank)
    started, cpu = time.perf_counter(), time.process_time()
    summary, _ = summary_of(storage, plan, rank, TOKEN, files)
    payload = json.dumps(SummaryReport(summary, state_digest(plan), plan.aliases).to_json(), separators=(",", ":"))
    return time.perf_counter() - started, time.process_time() - cpu, payload


def write_indexed(save_ranks: int, root: str) -> tuple[list[float], list[float], str]:
    """Every writer's part (two at a time, as separate processes: writers run in parallel in a job); returns
    the wall and CPU seconds each took and the file holding what rank 0 gathers (one payload per line)."""
    import functools
    import multiprocessing

    gathered = os.path.join(root, "gathered.jsonl")
    with multiprocessing.get_context("fork").Pool(2) as pool:
        parts = pool.map(functools.partial(writer_part, save_ranks, root), range(save_ranks), chunksize=8)
    with open(gathered, "w") as out:
        out.writelines(payload + "\n" for _, _, payload in parts)
    return [p[0] for p in parts], [p[1] for p in parts], gathered


def commit_child(root: str, save_ranks: int) -> None:
    """Rank 0's part, alone in a fresh process: decode what it gathered, build, check and commit the
    manifest (``commit_gathered``, as ``save`` runs it); prints seconds and peak RSS above the start."""
    from types import SimpleNamespace

    from shardkit.checkpoint.formats.native import NativeWriter
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.checkpoint.training.rank_report import report_from_json
    from shardkit.checkpoint.training.save_commit import commit_gathered

    plan = save_plan(save_ranks, 0)
    storage = Storage(root)
    writer = NativeWriter(storage)
    before = rss()
    started = time.perf_counter()
    with open(os.path.join(root, "gathered.jsonl"), "rb") as f:
        gathered = [json.loads(line) for line in f]
    reports = [report_from_json(g) for g in gathered]
    error = commit_gathered(storage, writer, plan, reports, SimpleNamespace(world_size=save_ranks), {"step": 1000},
                            True)
    seconds = time.perf_counter() - started
    if error is not None:
        raise SystemExit(f"rank 0's commit failed: {error}")
    print(json.dumps({"seconds": seconds, "rss": high_water_rss() - before}))


def child(path: str, load_ranks: int) -> None:
    """One loading rank: what ``load`` does before its first data read -- open the checkpoint, say which
    boxes it loads (a version-3 reader then reads the index files that cover them), plan the reads."""
    import torch

    import shardkit.checkpoint.formats.native.reader  # noqa: F401 - a loading job has shardkit imported already
    from shardkit.checkpoint.formats import open_reader
    from shardkit.checkpoint.formats.base import plan_reads

    rank = load_ranks // 2
    before_rss, before_read = rss(), rchar()
    start = time.perf_counter()
    boxes = {}
    for fqn, shape in state_tensors().items():  # the target state dict knows its shapes
        if not shape:
            boxes[fqn] = ((), ())
            continue
        lo, n = row_range(shape[0], load_ranks, rank)
        if n:
            boxes[fqn] = ((lo,) + (0,) * (len(shape) - 1), (n,) + shape[1:])
    reader = open_reader(path, format="shardkit")
    reader.focus({fqn: [box] for fqn, box in boxes.items()})
    entries = reader.tensors()
    wanted = [(fqn, box, torch.empty(box[1], dtype=entries[fqn].dtype, device="meta")) for fqn, box in boxes.items()]
    requests = plan_reads(reader, wanted)
    seconds = time.perf_counter() - start
    peak = high_water_rss()
    print(json.dumps({"seconds": seconds, "read": rchar() - before_read, "rss": peak - before_rss,
                      "requests": len(requests)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save-ranks", type=int, default=1024)
    parser.add_argument("--load-ranks", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/shardkit-manifest-scale")
    parser.add_argument("--format", choices=("1", "3", "both"), default="both",
                        help="format version to measure: 1 (every chunk in manifest.json), 3 (index files)")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--commit-child", action="store_true")
    args = parser.parse_args()
    if args.child:
        return child(args.dir, args.load_ranks)
    if args.commit_child:
        return commit_child(args.dir, args.save_ranks)
    print(f"synthetic 70B checkpoint saved at {args.save_ranks} ranks, loaded by one rank of {args.load_ranks} "
          f"(rank {args.load_ranks // 2}); medians of {args.reps} children")
    for version in (1, 3) if args.format == "both" else (int(args.format),):
        measure(args, version)


def run_child(args: argparse.Namespace, flag: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), flag, "--dir", args.dir, "--load-ranks",
                           str(args.load_ranks), "--save-ranks", str(args.save_ranks)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def verdict(name: str, ours: float, limit: float, unit: str) -> None:
    print(f"  {name:48s} {ours:10.2f} {unit} (<= {limit:g} {unit})  {'MET' if ours <= limit else 'MISSED'}")


def save_indexed(args: argparse.Namespace) -> str:
    """Version 3 as ``save`` writes it: each writer's part (timed one by one), then rank 0's in a fresh
    process; prints both against their targets and returns what describes the checkpoint."""
    seconds, cpu, gathered = write_indexed(args.save_ranks, args.dir)
    gathered_bytes = os.path.getsize(gathered)
    commit = run_child(args, "--commit-child")
    os.unlink(gathered)
    size = os.path.getsize(os.path.join(args.dir, "manifest.json"))
    names = os.listdir(os.path.join(args.dir, "index"))
    index_bytes = sum(os.path.getsize(os.path.join(args.dir, "index", n)) for n in names)
    print(f"  each writer's part (check its chunks, write its index file, summarise): max {max(seconds):.3f} s, "
          f"median {statistics.median(seconds):.3f} s over {len(seconds)} writers (CPU: max {max(cpu):.3f} s, "
          f"median {statistics.median(cpu):.3f} s)")
    print(f"  rank 0's part (decode {gathered_bytes / 1e6:.2f} MB of summaries, build, check and commit "
          f"manifest.json): {commit['seconds']:.2f} s, peak RSS +{commit['rss'] / 1e6:.0f} MB")
    verdict("v3 rank 0's commit", commit["seconds"], 2.0, "s")
    verdict("v3 peak RSS of rank 0's commit", commit["rss"] / 1e6, 200.0, "MB")
    verdict("v3 each writer's index file (max)", max(seconds), 1.0, "s")
    verdict("v3 each writer's index file (max CPU time)", max(cpu), 1.0, "s")
    return f"manifest.json {size / 1e6:.2f} MB + {len(names)} index files, {index_bytes / 1e6:.0f} MB in all"


def measure(args: argparse.Namespace, version: int) -> None:
    """Write the synthetic checkpoint's metadata in ``version``, time ``--reps`` loading children, print."""
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(os.path.join(args.dir, "data"))
    started = time.perf_counter()
    print(f"\nformat version {version}: {len(state_tensors())} tensors")
    if version == 3:
        how = save_indexed(args)
    else:
        doc = make_manifest(args.save_ranks)
        n_chunks = sum(len(t["chunks"]) for t in doc["tensors"].values())
        data = json.dumps(doc, separators=(",", ":")).encode()
        with open(os.path.join(args.dir, "manifest.json"), "wb") as f:
            f.write(data)
        how = f"{n_chunks} chunks, {len(doc['files'])} data files; manifest.json {len(data) / 1e6:.1f} MB"
        del data, doc
    print(f"  {how} (made in {time.perf_counter() - started:.0f} s)")
    runs = []
    for rep in range(args.reps):
        runs.append(run_child(args, "--child"))
        print(f"  child {rep + 1}/{args.reps}: {runs[-1]}", file=sys.stderr, flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "read", "rss")}
    print(f"  one loading rank reads {med['read'] / 1e6:.2f} MB of metadata, open + plan {med['seconds']:.2f} s, "
          f"peak RSS +{med['rss'] / 1e6:.0f} MB ({runs[0]['requests']} read requests planned)")
    verdict(f"v{version} metadata read by a loading rank", med["read"] / 1e6, 5.0, "MB")
    verdict(f"v{version} open + plan one rank's load", med["seconds"], 1.0, "s")
    verdict(f"v{version} peak RSS of open + plan", med["rss"] / 1e6, 200.0, "MB")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
