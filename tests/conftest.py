"""Shared fixtures: three real object-store APIs on loopback, and CUDA gating.

Each server runs as its own process on 127.0.0.1 and a free port for the whole
session, started by its fixture and stopped after the last test:

* S3: moto's server (``s3_server``; ``s3_url`` gives a fresh bucket);
* Google Cloud Storage: ``gcp-storage-emulator`` from PyPI (``gcs_server``;
  ``gcs_url`` gives a fresh bucket);
* Azure Blob: azurite from npm (``azure_server``; ``azure_url`` gives a fresh
  container).  ``make test`` installs it under ``.venv/node``; without node the
  Azure tests are skipped, saying so.

Clients reach them over HTTP exactly as they would reach the clouds, through
``s3fs``, ``gcsfs`` and ``adlfs`` with the ``storage_options`` the fixtures hand
out.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.support.s3_server import free_port, moto_server, stop_server

# gcsfs (2026.x) asks a gRPC control API for each bucket's type before working on it; an emulator has no
# such API and every call would wait out a 60 s timeout.  Set before gcsfs is imported, here or in the
# ranks that tests/support/dist.py starts (they inherit the environment).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

REPO = Path(__file__).resolve().parent.parent
# azurite's well-known development account (public, documented by Microsoft; it guards nothing)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url`` (any status: an error page is an answer)."""
    try:
        urllib.request.urlopen(url, timeout=1).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _serving(name: str, argv: list[str], ready: Callable[[], bool], log: Path) -> Iterator[None]:
    """Run ``argv`` as a server in its own session until the block ends; wait up to 60 s for ``ready()``."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} did not start ({' '.join(argv)}); its output:\n{tail}")
            time.sleep(0.1)
        yield
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")
def s3_server():
    """Start ``moto.server`` on loopback; yield ``(endpoint_url, storage_options)``."""
    with moto_server() as served:
        yield served


@pytest.fixture
def s3_url(s3_server):
    """A fresh, empty bucket: yields ``("s3://<bucket>", storage_options)``."""
    import s3fs

    _, options = s3_server
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(bucket)
    yield f"s3://{bucket}", options


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """Start ``gcp-storage-emulator`` (in memory) on loopback; yield ``(endpoint_url, storage_options)``."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
            "--in-memory", "--quiet"]
    log = tmp_path_factory.mktemp("gcs-server") / "server.log"
    with _serving("gcp-storage-emulator", argv, lambda: _answers(f"{endpoint}/storage/v1/b"), log):
        yield endpoint, {"endpoint_url": endpoint, "token": "anon", "project": "shardkit-test"}


@pytest.fixture
def gcs_url(gcs_server):
    """A fresh, empty bucket: yields ``("gs://<bucket>", storage_options)``."""
    import gcsfs

    _, options = gcs_server
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    gcsfs.GCSFileSystem(**options).mkdir(bucket)
    yield f"gs://{bucket}", options


def _azurite() -> list[str]:
    """The command that runs azurite's blob service: installed by ``make test`` under .venv/node."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("the Azure Blob tests need Node.js to run azurite (the Azure emulator, from npm); "
                    "install node, then `make test` installs azurite under .venv/node")
    local = REPO / ".venv" / "node" / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return [node, str(local)]
    found = shutil.which("azurite-blob")
    if found is None:
        pytest.fail("azurite is not installed: run `make test` (or `npm install --prefix .venv/node azurite`)")
    return [found]


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """Start azurite's blob service on loopback; yield ``(endpoint_url, storage_options)``."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    workspace = tmp_path_factory.mktemp("azure-server")
    argv = _azurite() + ["--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(workspace),
                         "--silent", "--disableTelemetry", "--skipApiVersionCheck"]
    with _serving("azurite", argv, lambda: _answers(f"{endpoint}?comp=list"), workspace / "server.log"):
        yield endpoint, {"connection_string": f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                                              f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"}


@pytest.fixture
def azure_url(azure_server):
    """A fresh, empty container: yields ``("az://<container>", storage_options)``."""
    import adlfs

    _, options = azure_server
    container = f"test-{uuid.uuid4().hex[:12]}"
    adlfs.AzureBlobFileSystem(**options).mkdir(container)
    yield f"az://{container}", options


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    """Between tests, replace rank pools crowded with earlier tests' process groups (see tests/support/dist.py)."""
    from tests.support.dist import recycle_crowded_pools

    recycle_crowded_pools()
