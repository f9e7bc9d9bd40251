"""Checkpoints on three real object-store APIs, and storage failures that say what is wrong, fast.

The clouds run on loopback, each started by a fixture of conftest.py: S3 (moto), Google Cloud
Storage (gcp-storage-emulator) and Azure Blob (azurite).

* A 2-rank save to GCS and to Azure loads at 3 ranks bitwise.
* A checkpoint migrates S3 → GCS → Azure → local with the offline reshard; each hop into a cloud is
  interrupted after its first data file and rerun, the rerun keeps that file, and the local copy
  loads at 3 ranks bitwise equal to what the training job saved.
* S3 failures end in under 10 s with one line saying what is wrong and what to set: no credentials,
  no such bucket, an endpoint that refuses connections or never answers.  Requests are retried by
  one layer (shardkit's), as often as ``--retries`` says.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.checkpoint import diff, reshard, verify
from shardkit.checkpoint.formats.native.ownership import RESUME_DIR
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import (
    BucketNotFound,
    ConfigurationError,
    EndpointUnreachable,
    MissingCredentials,
    StorageError,
)
from tests.support.checkpoint_helpers import load_into_fresh, mismatches, save_trained_two_steps
from tests.support.dist import run_on_ranks
from tests.support.models import ModelArgs
from tests.support.offline_cli import CliResult, run_cli

ENDPOINT_HELP = "check AWS_ENDPOINT_URL (or the storage option client_kwargs.endpoint_url)"
CREDENTIALS_HELP = ("no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                    "or pass the storage options key and secret (anon=true for a public bucket)")


# --------------------------------------------------------------------------
# save, load and migrate across clouds

# The checkpoint helpers' Transformer with one block instead of three (both FSDP levels, the same uneven
# dims): every tensor is a few small ranged requests to each emulator, and nothing here depends on how
# many blocks there are.
ONE_BLOCK = ModelArgs(n_layers=1)


@pytest.mark.parametrize("cloud", ["gcs_url", "azure_url"], ids=["gcs", "azure"])
def test_two_rank_save_to_the_cloud_loads_at_three_ranks_bitwise(cloud, request):
    root, options = request.getfixturevalue(cloud)
    url = f"{root}/run/ckpt"
    saved = run_on_ranks(2, save_trained_two_steps, url, options, None, ONE_BLOCK)[0]
    loaded = run_on_ranks(3, load_into_fresh, url, options, "shardkit", ONE_BLOCK)[0]
    assert mismatches(saved, loaded) == []


class _Interrupted(Exception):
    """Stands in for a kill between two data files of a hop."""


def _resumed_hop(src: str, src_options: dict, dst: str, dst_options: dict, monkeypatch, world_size: int) -> None:
    """``reshard`` SRC → DST stopped right after its first data file landed (file and journal entry),
    then rerun: the rerun keeps exactly that file's bytes and commits."""
    put_atomic = Storage.put_atomic

    def put_then_stop(self, name, data):
        put_atomic(self, name, data)
        if name.startswith(f"{RESUME_DIR}/"):
            raise _Interrupted(name)

    hop = dict(world_size=world_size, workers=1, storage_options=src_options, dst_storage_options=dst_options)
    with monkeypatch.context() as m:
        m.setattr(Storage, "put_atomic", put_then_stop)
        with pytest.raises(_Interrupted):
            reshard(src, dst, **hop)
    storage = Storage(dst, dst_options)
    journal = storage.listdir(RESUME_DIR)
    assert len(journal) == 1 and not storage.exists("manifest.json")
    entry = json.loads(storage.read_bytes(f"{RESUME_DIR}/{journal[0]}"))
    landed = sum(record["nbytes"] for _, record in entry["file"]["chunks"])  # stored raw: no compression

    result = reshard(src, dst, **hop)
    assert 0 < result.skipped_bytes == landed < result.bytes
    assert storage.exists("manifest.json") and not storage.exists(RESUME_DIR)
    assert verify(dst, storage_options=dst_options).ok


@pytest.mark.slow
def test_migration_s3_to_gcs_to_azure_to_local_resumes_interrupted_hops_and_loads_bitwise(
        s3_url, gcs_url, azure_url, tmp_path, monkeypatch):
    (s3, s3_options), (gs, gs_options), (az, az_options) = s3_url, gcs_url, azure_url
    on_s3, on_gcs, on_azure = f"{s3}/run/step-2", f"{gs}/run/step-2-ws3", f"{az}/run/step-2-ws4"
    saved = run_on_ranks(2, save_trained_two_steps, on_s3, s3_options, None, ONE_BLOCK)[0]

    _resumed_hop(on_s3, s3_options, on_gcs, gs_options, monkeypatch, world_size=3)
    _resumed_hop(on_gcs, gs_options, on_azure, az_options, monkeypatch, world_size=4)
    local = str(tmp_path / "step-2-ws2")
    reshard(on_azure, local, world_size=2, compression="zstd", storage_options=az_options, dst_storage_options={})

    assert diff(on_s3, local, storage_options=s3_options, b_storage_options={}).equal
    loaded = run_on_ranks(3, load_into_fresh, local, None, "shardkit", ONE_BLOCK)[0]
    assert mismatches(saved, loaded) == []


# --------------------------------------------------------------------------
# failures: one line, under 10 s


def _closed_port_endpoint() -> str:
    """An endpoint on loopback where nothing listens: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _data_file_named(message: str, url: str) -> str:
    """``message`` with the (random) name of the data file a save was writing under ``url`` replaced by <file>."""
    return re.sub(re.escape(f"{url}/data/") + r"[0-9a-f]+-\d+-\d+\.safetensors", f"{url}/data/<file>", message)


def _fresh_client(endpoint: str | None = None) -> list[str]:
    """CLI storage options: a client made for this call (fsspec's instance cache would hand a later test
    the client, and the credentials, of an earlier one), at ``endpoint`` when given."""
    return ["--storage-option", "skip_instance_cache:=true"] + (
        ["--storage-option", f"client_kwargs.endpoint_url={endpoint}"] if endpoint else [])


def _timed_cli(*args: str) -> tuple[str, float]:
    """Run ``shardkit -q *args``, expect a failure: (its one stderr line, seconds taken)."""
    start = time.monotonic()
    result: CliResult = run_cli("-q", *args)
    seconds = time.monotonic() - start
    assert result.exit_code == 1, (result.exit_code, result.stderr)
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    return result.stderr.rstrip("\n"), seconds


def _timed_save(url: str, options: dict, expected: type[StorageError]) -> tuple[str, float]:
    """``skc.save`` a small state to ``url``, expect ``expected``: (its message, seconds taken)."""
    start = time.monotonic()
    with pytest.raises(expected) as info:
        skc.save({"w": torch.ones(4)}, url, storage_options=options)
    return str(info.value), time.monotonic() - start


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """No AWS credentials wherever botocore looks: variables, files; instance metadata switched off."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def aws_test_credentials(monkeypatch):
    """Credentials that sign requests (the servers in these tests do not check them)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_missing_s3_credentials_fail_in_one_line_naming_the_variables(s3_url, no_aws_credentials):
    root, options = s3_url
    endpoint = options["client_kwargs"]["endpoint_url"]
    url = f"{root}/ckpt"
    message, seconds = _timed_save(url, {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True},
                                   MissingCredentials)
    assert seconds < 10
    assert _data_file_named(message, url) == f"writing {url}/data/<file>: {CREDENTIALS_HELP}"
    line, seconds = _timed_cli("inspect", url, *_fresh_client(endpoint))
    assert seconds < 10
    assert line == f"error: checking {url}: {CREDENTIALS_HELP}"


def test_missing_bucket_fails_in_one_line_naming_the_bucket(s3_server, aws_test_credentials):
    endpoint, options = s3_server
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    url = f"s3://{bucket}/ckpt"
    missing = f"bucket {bucket!r} does not exist at the S3 endpoint {endpoint}; create it or fix the URL"
    message, seconds = _timed_save(url, options, BucketNotFound)
    assert seconds < 10
    assert _data_file_named(message, url) == f"writing {url}/data/<file>: {missing}"
    line, seconds = _timed_cli("inspect", url, *_fresh_client(endpoint))
    assert seconds < 10
    assert line == f"error: checking {url}: {missing}"


def test_unreachable_endpoint_fails_in_one_line_naming_the_endpoint(aws_test_credentials, monkeypatch):
    endpoint = _closed_port_endpoint()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # the endpoint comes from the environment alone
    url = "s3://ckpts/run"
    refused = f"cannot reach the S3 endpoint {endpoint} (connection refused); {ENDPOINT_HELP} and the network"
    message, seconds = _timed_save(url, {"skip_instance_cache": True}, EndpointUnreachable)
    assert seconds < 10
    assert _data_file_named(message, url) == f"writing {url}/data/<file>: {refused}"
    line, seconds = _timed_cli("inspect", url, *_fresh_client())
    assert seconds < 10
    assert line == f"error: checking {url}: {refused}"


SILENT_ENDPOINT_BOUND_S = 6


def test_an_endpoint_that_never_answers_fails_within_the_timeout(aws_test_credentials):
    with socket.socket() as silent:  # accepts connections (the kernel does), never answers a request
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        url = "s3://ckpts/run"
        options = {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
        no_answer = (f"the S3 endpoint {endpoint} did not answer within 1 s; {ENDPOINT_HELP}, or allow more "
                     "time with --timeout (storage option shardkit.timeout)")
        # 1 s of timeout, and at most a few seconds of a busy machine around it (the suite runs two workers);
        # botocore left to itself waits 60 s per attempt, with retries on top
        message, seconds = _timed_save(url, {**options, "shardkit": {"timeout": 1}}, EndpointUnreachable)
        assert seconds < SILENT_ENDPOINT_BOUND_S
        assert _data_file_named(message, url) == f"writing {url}/data/<file>: {no_answer}"
        line, seconds = _timed_cli("inspect", url, *_fresh_client(endpoint),
                                   "--timeout", "1")
        assert seconds < SILENT_ENDPOINT_BOUND_S
        assert line == f"error: checking {url}: {no_answer}"


class _Unavailable(BaseHTTPRequestHandler):
    """Answers every request with 503 and counts them."""
    protocol_version = "HTTP/1.1"  # answers "Expect: 100-continue" so that bodies are sent
    requests: list[str] = []

    def _unavailable(self) -> None:
        self.requests.append(self.command)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _unavailable

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def unavailable_s3(aws_test_credentials):
    """An S3 endpoint on loopback that answers 503 to everything: yields (endpoint, request log)."""
    _Unavailable.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Unavailable.requests
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("retries", [0, 2])
def test_a_failing_request_is_retried_by_shardkit_alone_as_often_as_asked(unavailable_s3, retries, caplog):
    endpoint, requests = unavailable_s3
    url = "s3://ckpts/run"
    caplog.set_level(logging.DEBUG, logger="shardkit.checkpoint.io.storage")
    result = run_cli("-q", "inspect", url, *_fresh_client(endpoint), "--retries", str(retries))
    attempts = retries + 1
    *warned, line = result.stderr.splitlines()
    assert result.exit_code == 1 and result.stdout == ""
    assert line.startswith(f"error: checking {url} failed" + (f" after {attempts} attempts: " if retries else ": "))
    # the first retry of a URL is one WARNING (shown even under -q), the other attempts are logged at DEBUG
    assert len(warned) == (1 if retries else 0)
    assert all(w.startswith(f"WARNING shardkit.checkpoint.io.storage: checking {url}: attempt 1 of {attempts} failed "
                            "(OSError: [Errno 16] Service Unavailable (503, HTTP 503)); retrying in ") for w in warned)
    assert len(requests) == attempts  # neither botocore nor s3fs retried underneath
    records = [r for r in caplog.records if r.name == "shardkit.checkpoint.io.storage"]
    logged = [r.getMessage() for r in records]
    assert [r.levelno for r in records] == ([logging.WARNING] + [logging.DEBUG] * (retries - 1) if retries else [])
    assert all(m.startswith(f"checking {url}: attempt {i + 1} of {attempts} failed (") for i, m in enumerate(logged))


@pytest.mark.parametrize("cloud,word,provider", [("gcs", "bucket", "GCS"), ("azure", "container", "Azure Blob")],
                         ids=["gcs", "azure"])
def test_a_missing_gcs_bucket_or_azure_container_is_named(cloud, word, provider, request):
    endpoint, options = request.getfixturevalue(f"{cloud}_server")
    name = f"no-such-{word}-{uuid.uuid4().hex[:8]}"
    url = f"{'gs' if cloud == 'gcs' else 'az'}://{name}/ckpt"
    with pytest.raises(BucketNotFound) as info:
        skc.inspect(url, storage_options=options)
    assert str(info.value) == (f"checking {url}: {word} {name!r} does not exist at the {provider} endpoint "
                               f"{endpoint}; create it or fix the URL")


def test_azure_without_an_account_fails_in_one_line_naming_the_variables(monkeypatch):
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"):
        monkeypatch.delenv(name, raising=False)
    line, seconds = _timed_cli("inspect", "az://ckpts/run")
    assert seconds < 10
    assert line == ("error: opening az://ckpts/run: no Azure credentials found; set AZURE_STORAGE_CONNECTION_STRING, "
                    "or AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY, or pass the storage options "
                    "connection_string, or account_name and account_key")


def test_aws_endpoint_url_alone_points_shardkit_at_an_s3_compatible_service(s3_url, monkeypatch):
    root, options = s3_url
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["client_kwargs"]["endpoint_url"])
    plain = {"key": "testing", "secret": "testing", "skip_instance_cache": True}  # no endpoint option at all
    skc.save({"w": torch.arange(6.0)}, f"{root}/ckpt", storage_options=plain)
    target = {"w": torch.zeros(6)}
    skc.load(target, f"{root}/ckpt", storage_options=plain)
    assert torch.equal(target["w"], torch.arange(6.0))


def test_shardkit_storage_options_are_checked_and_not_passed_to_fsspec():
    storage = Storage("memory://clouds-options", {"shardkit": {"retries": 0, "timeout": 2.5}})
    assert (storage.cloud.retries, storage.cloud.timeout) == (0, 2.5)
    assert "shardkit" not in storage.cloud.options and storage.storage_options == {
        "shardkit": {"retries": 0, "timeout": 2.5}}
    with pytest.raises(ConfigurationError) as info:
        Storage("memory://clouds-options", {"shardkit": {"retry": 1}})
    assert str(info.value) == ("unknown storage option shardkit.retry; shardkit's own options are shardkit.retries "
                               "and shardkit.timeout")
    with pytest.raises(ConfigurationError) as info:
        Storage("memory://clouds-options", {"shardkit": {"timeout": 0}})
    assert str(info.value) == "storage option shardkit.timeout must be a number of seconds above 0, got 0"
