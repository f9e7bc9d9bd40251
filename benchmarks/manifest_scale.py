"""The metadata one loading rank must read, parse and plan from: a synthetic 70B checkpoint at scale (no data).

A LLaMA-3-70B-shaped state -- 723 fp32 parameters (80 layers of dim 8192,
ffn 28672, 8 KV heads; vocabulary 128256), each with AdamW's two moments and
a ``step`` -- is "saved" by FSDP (``Shard(0)``) at ``--save-ranks`` ranks:
every rank writes its row range of every tensor (split at the writer's 64 MiB
chunk cap) into 4 data files, rank 0 the steps.  Only the metadata is made:
the manifest holds the records the native writer would write -- same keys,
file names, offsets, byte counts, checksum blocks (256 KiB) and checksum
lists -- and no data file exists.  Each format version is measured in turn:
version 1 (every chunk record in ``manifest.json``, what small checkpoints
still get) and version 3 (the writer's own ``split_into_indexes``: per-tensor
regions by rule in the manifest, each writer's chunk records in its index
file).

A child process then stands in for one rank (the middle one) of an FSDP job
of ``--load-ranks`` ranks and does what ``load`` does before its first data
read: open the checkpoint (read and validate the metadata -- for version 3,
the manifest and the index files of the writers it needs) and plan the reads
of its row range of every tensor, into meta tensors (so the targets take no
memory).  Reported: the metadata bytes it read (``rchar`` of
``/proc/self/io``), seconds for open + plan, and peak RSS (``VmHWM``) above
the child's RSS before it opened the checkpoint.  Targets (issue 13): at most 5 MB,
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


def make_manifest(save_ranks: int) -> dict:
    """Today's format (docs/format.md, version 1): every chunk a record in the one manifest."""
    from shardkit.checkpoint.geometry.boxes import split_box

    tensors = state_tensors()
    token = "5eed5eed5e"
    records: dict[str, list] = {k: [] for k in tensors}
    files: dict[str, dict] = {}
    for rank in range(save_ranks):
        chunks = []  # (fqn, offsets, shape, nbytes)
        for fqn, shape in tensors.items():
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
        for fqn, offsets, sub, nbytes in chunks:
            if filled and filled + nbytes > per_file and part < FILES_PER_RANK - 1:
                files[f"data/{token}-{rank}-{part}.safetensors"] = {"size": pos, "writer": rank}
                part, filled, pos = part + 1, 0, 0
            if pos == 0:
                pos = 8 + 4096  # the safetensors header (its size does not matter here)
            key = f"{fqn}@{','.join(map(str, offsets))}"
            records[fqn].append({"offsets": list(offsets), "shape": list(sub),
                                 "file": f"data/{token}-{rank}-{part}.safetensors", "key": key, "start": pos,
                                 "nbytes": nbytes, "codec": "raw", "block": BLOCK,
                                 "crc32c": pack_crcs(max(1, -(-nbytes // BLOCK)), zlib.crc32(key.encode()))})
            pos += nbytes
            filled += nbytes
        if pos:
            files[f"data/{token}-{rank}-{part}.safetensors"] = {"size": pos, "writer": rank}
    return {"format": "shardkit", "version": 1, "meta": {"step": 1000},
            "writer": {"world_size": save_ranks, "mesh": {"shape": [save_ranks], "dim_names": ["dp"],
                                                          "placements": ["S(0)"]}},
            "tensors": {fqn: {"dtype": "F32", "shape": list(shape), "chunks": records[fqn]}
                        for fqn, shape in tensors.items()},
            "values": {}, "files": files}


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


def write_indexed(doc: dict, root: str) -> tuple[int, float]:
    """Commit ``doc`` as format version 3 with the writer's own code (rules derived from the chunk records,
    one index file per writer); return (bytes of manifest.json, seconds the split took)."""
    from shardkit.checkpoint.formats.codec import unpack_crcs
    from shardkit.checkpoint.formats.native.index import dump_indexed_manifest, split_into_indexes
    from shardkit.checkpoint.formats.native.manifest import (
        ChunkRecord,
        FileRecord,
        Manifest,
        TensorRecord,
    )

    def record(c: dict) -> ChunkRecord:
        crcs = tuple(unpack_crcs(c["crc32c"], max(1, -(-c["nbytes"] // c["block"])), "synthetic"))
        return ChunkRecord(tuple(c["offsets"]), tuple(c["shape"]), c["file"], c["key"], c["start"], c["nbytes"],
                           c["codec"], c["block"], crcs)

    manifest = Manifest(tensors={fqn: TensorRecord(t["dtype"], tuple(t["shape"]), tuple(map(record, t["chunks"])))
                                 for fqn, t in doc["tensors"].items()},
                        files={n: FileRecord(f["size"], f["writer"]) for n, f in doc["files"].items()},
                        meta=doc["meta"], writer=doc["writer"])
    started = time.perf_counter()
    indexed, files = split_into_indexes(manifest, "5eed5eed5e")
    seconds = time.perf_counter() - started
    os.makedirs(os.path.join(root, "index"), exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
    data = dump_indexed_manifest(indexed)
    with open(os.path.join(root, "manifest.json"), "wb") as f:
        f.write(data)
    return len(data), seconds


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
    args = parser.parse_args()
    if args.child:
        return child(args.dir, args.load_ranks)
    print(f"synthetic 70B checkpoint saved at {args.save_ranks} ranks, loaded by one rank of {args.load_ranks} "
          f"(rank {args.load_ranks // 2}); medians of {args.reps} children")
    for version in (1, 3) if args.format == "both" else (int(args.format),):
        measure(args, version)


def measure(args: argparse.Namespace, version: int) -> None:
    """Write the synthetic checkpoint's metadata in ``version``, time ``--reps`` loading children, print."""
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(os.path.join(args.dir, "data"))
    started = time.perf_counter()
    doc = make_manifest(args.save_ranks)
    n_chunks = sum(len(t["chunks"]) for t in doc["tensors"].values())
    n_tensors, n_files = len(doc["tensors"]), len(doc["files"])
    if version == 3:
        size, split = write_indexed(doc, args.dir)
        index_bytes = sum(os.path.getsize(os.path.join(args.dir, "index", n))
                          for n in os.listdir(os.path.join(args.dir, "index")))
        how = (f"manifest.json {size / 1e6:.2f} MB + {n_files // FILES_PER_RANK} index files, "
               f"{index_bytes / 1e6:.0f} MB in all (the writer's split took {split:.0f} s)")
    else:
        data = json.dumps(doc, separators=(",", ":")).encode()
        with open(os.path.join(args.dir, "manifest.json"), "wb") as f:
            f.write(data)
        how = f"manifest.json {len(data) / 1e6:.1f} MB"
        del data
    del doc
    print(f"\nformat version {version}: {n_tensors} tensors, {n_chunks} chunks, {n_files} data files; {how} "
          f"(made in {time.perf_counter() - started:.0f} s)")
    runs = []
    for rep in range(args.reps):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--dir", args.dir,
                               "--load-ranks", str(args.load_ranks)], capture_output=True, text=True, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"  child {rep + 1}/{args.reps}: {runs[-1]}", file=sys.stderr, flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "read", "rss")}
    print(f"  one loading rank reads {med['read'] / 1e6:.2f} MB of metadata, open + plan {med['seconds']:.2f} s, "
          f"peak RSS +{med['rss'] / 1e6:.0f} MB ({runs[0]['requests']} read requests planned)")
    for name, ours, limit, unit in (("metadata read by a loading rank", med["read"] / 1e6, 5.0, "MB"),
                                    ("open + plan one rank's load", med["seconds"], 1.0, "s"),
                                    ("peak RSS of open + plan", med["rss"] / 1e6, 200.0, "MB")):
        print(f"  v{version} {name:40s} {ours:10.2f} {unit} (<= {limit:g} {unit})  "
              f"{'MET' if ours <= limit else 'MISSED'}")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
