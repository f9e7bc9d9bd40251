"""Move a checkpoint to object storage and back, resharding on the way -- through the library.

The same steps as the worked example in docs/cli.md, with ``shardkit.checkpoint`` calls:

1. a training job (here: a small model, one AdamW step, one process) saves a checkpoint;
2. ``reshard`` streams it to S3 laid out for 4 ranks, zstd-compressed, chunk by chunk;
3. ``verify`` checks every checksum on S3;
4. ``reshard`` brings it back for 2 ranks, and ``diff`` proves every tensor is bit-identical.

Without ``--endpoint`` the example starts a local S3 server (moto, on 127.0.0.1) so it runs
anywhere; with ``--endpoint URL --bucket NAME`` it talks to that S3-compatible service instead
(credentials from the usual AWS environment variables).

    python examples/cloud_migration.py
    python examples/cloud_migration.py --endpoint http://127.0.0.1:9000 --bucket ckpts
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from typing import Iterator

import torch
import torch.nn as nn

import shardkit.checkpoint as skc


@contextlib.contextmanager
def local_s3() -> Iterator[str]:
    """A moto S3 server on a free loopback port, for the lifetime of the block."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


def train_and_save(url: str) -> None:
    """Stand-in for a training job: a small model, one AdamW step, a shardkit checkpoint."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1000))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 1000, (8, 32))
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optim.step()
    skc.save(skc.get_training_state(model, optim), url)


def migrate(local_dir: str, s3_root: str, options: dict) -> None:
    src = os.path.join(local_dir, "step-1")
    train_and_save(src)
    print(f"saved {src}: {skc.inspect(src)['totals']['bytes'] / 1e6:.1f} MB")

    remote = f"{s3_root}/step-1-ws4"
    result = skc.reshard(src, remote, world_size=4, compression="zstd", workers=8, dst_storage_options=options)
    print(f"resharded to {remote}: {result.tensors} tensors for 4 ranks")
    info = skc.inspect(remote, storage_options=options)
    print(f"  layout {info['layout']}, {info['totals']['chunks']} chunks")

    report = skc.verify(remote, storage_options=options)
    print(f"verify {remote}: {'ok' if report.ok else report.problems} ({report.bytes_checked / 1e6:.1f} MB checked)")

    back = os.path.join(local_dir, "step-1-ws2")
    skc.reshard(remote, back, world_size=2, storage_options=options, dst_storage_options={})
    same = skc.diff(src, back)
    print(f"back to {back} for 2 ranks; bit-identical to the original: {same.equal}")
    if not (report.ok and same.equal):
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", help="S3-compatible endpoint URL (default: start a local moto server)")
    parser.add_argument("--bucket", help="bucket to use (default: a new one)")
    args = parser.parse_args()
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)
    with contextlib.ExitStack() as stack:
        endpoint = args.endpoint or stack.enter_context(local_s3())
        options = {"client_kwargs": {"endpoint_url": endpoint}}
        bucket = args.bucket or f"shardkit-example-{uuid.uuid4().hex[:8]}"
        if not args.bucket:
            import s3fs

            s3fs.S3FileSystem(**options).mkdir(bucket)
        local_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="shardkit-migration-"))
        migrate(local_dir, f"s3://{bucket}/run", options)


if __name__ == "__main__":
    main()
