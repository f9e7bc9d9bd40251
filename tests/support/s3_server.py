"""moto's S3 server on loopback, for the suite's fixtures and the benchmarks alike."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, Iterator

CREDENTIALS = (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
               ("AWS_DEFAULT_REGION", "us-east-1"))


def _ephemeral_ports() -> range:
    """The ports the kernel hands out to ``bind(0)`` and to outgoing connections."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port() -> int:
    """A loopback port, free now, for a server this process starts next (a moto, GCS or Azure emulator).

    Picked below the ephemeral range: a port the kernel gave out for ``bind(0)`` and freed again can be given
    to another process's outgoing connection or listener (gloo's, a TCPStore's) before the server binds it.
    Below that range only another caller of this function could take it, and picks are random among
    thousands."""
    ephemeral = _ephemeral_ports()
    candidates = [port for port in range(10000, 65536) if port not in ephemeral]
    for _ in range(100):
        port = random.choice(candidates)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range after 100 tries")


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
