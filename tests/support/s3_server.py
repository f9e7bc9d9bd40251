"""moto's S3 server on loopback, for the suite's fixtures and the benchmarks alike."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, Iterator

CREDENTIALS = (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
               ("AWS_DEFAULT_REGION", "us-east-1"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def s3_options(endpoint: str) -> dict[str, Any]:
    """The storage options that reach the server at ``endpoint`` with its test credentials."""
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint},
            "use_listings_cache": False, "skip_instance_cache": True}


@contextlib.contextmanager
def moto_server() -> Iterator[tuple[str, dict[str, Any]]]:
    """Start ``moto.server`` on a free loopback port; yield ``(endpoint_url, storage_options)``; stop it."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **dict(CREDENTIALS)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        for key, value in CREDENTIALS:
            os.environ.setdefault(key, value)
        yield endpoint, s3_options(endpoint)
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """End a server the suite started: asked first, killed after 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
