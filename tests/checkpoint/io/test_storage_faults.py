"""Storage faults on S3, injected by a proxy between shardkit and the moto server (tests/support/fault_proxy.py).

* Each fault -- 503 SlowDown, 429, 500, a connection reset, an answer cut short, a first byte later than
  the timeout -- on a save's writes and on a load's reads is retried, logged by one WARNING naming the
  URL (the other attempts at DEBUG), and the checkpoint loads bitwise.
* The same faults lasting longer than ``retries`` fail the save or load, in bounded time, with a
  ``StorageError`` naming the URL, the attempts and the last error; each request is sent once per
  attempt (neither botocore nor s3fs retries underneath); nothing is committed and the step saved
  before stays loadable.
* A multipart upload whose part fails is aborted: moto lists no upload in progress afterwards.
* Waits between attempts grow exponentially, are jittered, and never exceed 2 s, so an interrupt is
  never held long; ``interrupt_retries`` ends retrying threads at once.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit import errors
from shardkit.checkpoint.io.retries import BACKOFF_CAP_S, allow_retries, backoff_delay, interrupt_retries, with_retries
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ConfigurationError, StorageError
from tests.support.dist import run_on_ranks
from tests.support.fault_proxy import FaultProxy, options_through, part

STORAGE_LOG = "shardkit.checkpoint.io.storage"
TIMEOUT_S = 1.0
LAST_ERROR = {  # what the last error of each fault says, as the StorageError quotes it
    "slowdown": "Please reduce your request rate. (SlowDown, HTTP 503)",
    "throttle": "(TooManyRequests) when calling the",
    "internal": "We encountered an internal error. Please try again. (InternalError, HTTP 500)",
    "reset": "ConnectionResetError: [Errno 104] Connection reset by peer",
    "cut": "",  # a read: "Not enough data to satisfy content length header"; a write: the server closed
    "slow_first_byte": f"did not answer within {TIMEOUT_S:g} s after 3 attempts",
}
CUT = {"GET": "Not enough data to satisfy content length header",
       "PUT": "the server closed the connection before its answer was complete"}
KINDS = list(LAST_ERROR)
DELAY = {"slow_first_byte": TIMEOUT_S + 0.5}
# aiohttp resends an idempotent request once, at once, when a kept-alive connection breaks under it (its
# persistent-connection rule; no public switch): a reset or a cut may reach the proxy twice per attempt.
BREAKS_CONNECTION = {"reset", "cut"}
FIRST_FILE = r"/data/[0-9a-f]+-0-0\.safetensors$"  # a save writes two data files here, at once: fault one
SECOND_FILE = r"/data/[0-9a-f]+-0-1\.safetensors$"  # and one WARNING per URL: a read fault of its own file


@pytest.fixture(scope="module")
def faults_bucket(s3_server):
    """One bucket on moto for this module's tests (each works under a prefix of its own): (bucket, s3fs
    filesystem talking to moto directly, to look behind the proxy's back)."""
    import s3fs

    direct = s3fs.S3FileSystem(**s3_server[1])
    bucket = f"faults-{uuid.uuid4().hex[:12]}"
    direct.mkdir(bucket)
    return bucket, direct


@pytest.fixture
def proxied_s3(s3_server, faults_bucket):
    """A :class:`FaultProxy` in front of moto: yields (proxy, a fresh root URL, storage options through the
    proxy, moto's own s3fs filesystem)."""
    endpoint, options = s3_server
    bucket, direct = faults_bucket
    with FaultProxy(endpoint) as proxy:
        through = {**options_through(proxy, options), "shardkit": {"retries": 3, "timeout": TIMEOUT_S}}
        yield proxy, f"s3://{bucket}/{uuid.uuid4().hex[:8]}", through, direct


def _state(seed: int, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 1024, generator=g), "b": torch.randn(17, generator=g),
            "steps": torch.arange(5, dtype=torch.int64) * seed}


def _load(url: str, like: dict[str, torch.Tensor], options: dict) -> dict[str, torch.Tensor]:
    target = {k: torch.zeros_like(v) for k, v in like.items()}
    skc.load(target, url, storage_options=options)
    return target


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8).flatten(),
                                                                                  b[k].view(torch.uint8).flatten())
                                        for k in a)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == STORAGE_LOG and r.levelno >= logging.WARNING]


def _retried_once_each(caplog, url_part: str) -> list[str]:
    """The URLs the WARNINGs name: each retried URL once, each one a data file under ``url_part``."""
    warned = [m.split(": attempt 1 of 4 failed (")[0].split(" of ")[-1].removeprefix("writing ")
              for m in _warnings(caplog)]
    assert all(url_part in u for u in warned), warned
    return warned


def _whole_safetensors(direct, path: str) -> bool:
    """Whether the object at ``path`` is a whole safetensors file: its size is its header's promise."""
    data = direct.cat_file(path)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    return len(data) == 8 + n + end


def _options(options: dict, **own) -> dict:
    return {**options, "shardkit": {**options["shardkit"], **own}}


# --------------------------------------------------------------------------
# transient faults: retried, one WARNING per URL, bitwise


@pytest.mark.parametrize("kind", KINDS)
def test_a_transient_fault_on_writes_and_on_reads_is_retried_warned_once_per_url_and_loads_bitwise(
        kind, proxied_s3, caplog, monkeypatch):
    from shardkit.checkpoint.training import save_planning as save_module

    monkeypatch.setattr(save_module, "PARALLEL_FILE_BYTES", 1)  # a small state in two files written at once
    proxy, root, options, _ = proxied_s3
    url, state = f"{root}/step-1", _state(1)
    caplog.set_level(logging.DEBUG, logger=STORAGE_LOG)
    write = proxy.add(kind, method="PUT", path=FIRST_FILE, times=2, delay=DELAY.get(kind, 0.0))
    skc.save(state, url, storage_options=options)
    assert write.hits == 2
    assert len(_retried_once_each(caplog, f"{url}/data/")) == 1
    caplog.clear()
    read = proxy.add(kind, method="GET", path=SECOND_FILE, times=2, delay=DELAY.get(kind, 0.0))
    loaded = _load(url, state, options)
    assert read.hits == 2
    assert len(_retried_once_each(caplog, f"{url}/data/")) == 1
    assert _bitwise(loaded, state)


def test_a_url_retried_many_times_warns_once_and_logs_the_other_attempts_at_debug(proxied_s3, caplog):
    proxy, root, options, _ = proxied_s3
    url, state = f"{root}/step-1", _state(3)
    skc.save(state, url, storage_options=options)
    proxy.add("slowdown", method="GET", path=FIRST_FILE, times=3)  # 3 of the 4 attempts of one read
    caplog.set_level(logging.DEBUG, logger=STORAGE_LOG)
    assert _bitwise(_load(url, state, options), state)
    retried = [r for r in caplog.records if r.name == STORAGE_LOG and "failed (" in r.getMessage()]
    assert [r.levelno for r in retried] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert [r.getMessage().split(": attempt ")[1][:6] for r in retried] == ["1 of 4", "2 of 4", "3 of 4"]


# --------------------------------------------------------------------------
# faults that outlast the retries: a StorageError naming the URL and the last error, nothing committed


def _expect_failure(kind: str, method: str, run, proxy: FaultProxy) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        run()
    failed_at = time.monotonic()
    message = str(info.value)
    assert (CUT[method] if kind == "cut" else LAST_ERROR[kind]) in message, message
    faulted = [r for r in proxy.faults() if r.method == method]
    attempts = 3  # retries=2
    if kind in BREAKS_CONNECTION:
        assert attempts <= len(faulted) <= 2 * attempts
    else:
        assert len(faulted) == attempts  # one request per attempt: nothing retries underneath
    assert len({r.path for r in faulted}) == 1
    # from the first faulted request to the error: three attempts, two waits of at most 0.25 + 0.5 s, each
    # attempt under TIMEOUT_S, plus slack -- the save's or load's own work before that request is not the
    # retries' (on a busy 2-core machine it alone took seconds)
    seconds = failed_at - min(r.at for r in faulted)
    assert seconds < 3 * TIMEOUT_S + 0.75 + 2.0, seconds
    assert failed_at - start < 60.0  # and the call as a whole never hangs
    return message, seconds


@pytest.fixture(scope="module")
def earlier_step(s3_server, faults_bucket):
    """A step saved (straight to moto) before the faulted saves beside it: (its URL, its state)."""
    bucket, _ = faults_bucket
    url, state = f"s3://{bucket}/run/step-1", _state(4)
    skc.save(state, url, storage_options=s3_server[1])
    return url, state


@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_that_outlasts_the_retries_fails_naming_the_url_and_the_last_error_and_commits_nothing(
        kind, proxied_s3, earlier_step):
    proxy, _, options, direct = proxied_s3
    before_url, before = earlier_step
    run = before_url.rpartition("/")[0]
    url, fewer = f"{run}/step-2-{kind}", _options(options, retries=2)
    write = proxy.add(kind, method="PUT", path=rf"/step-2-{kind}" + FIRST_FILE, times=None,
                      delay=DELAY.get(kind, 0.0))
    message, _ = _expect_failure(kind, "PUT", lambda: skc.save(_state(5), url, storage_options=fewer), proxy)
    assert message.startswith(f"writing {url}/data/") and (kind == "slow_first_byte" or "after 3 attempts" in message)
    written = url.removeprefix("s3://") + "/"
    assert not direct.exists(written + "manifest.json")
    # nothing partial stored: the file the faults hit is absent, or whole where the server took the request
    # and only its answer was lost (a cut answer, one too late)
    assert all(_whole_safetensors(direct, p) for p in direct.find(written))
    assert kind in ("cut", "slow_first_byte") or not any(p.endswith("-0-0.safetensors") for p in direct.find(written))

    proxy.rules.remove(write)
    proxy.requests.clear()
    proxy.add(kind, method="GET", path=r"/step-1" + FIRST_FILE, times=None, delay=DELAY.get(kind, 0.0))
    message, _ = _expect_failure(kind, "GET", lambda: _load(before_url, before, fewer), proxy)
    assert re.match(rf"reading (\d+ bytes at \d+ of )?{re.escape(before_url)}/data/[0-9a-f]+-0-0\.safetensors",
                    message), message
    assert kind == "slow_first_byte" or "after 3 attempts" in message

    proxy.clear()
    assert _bitwise(_load(before_url, before, options), before)  # the step before: whole, loadable


# --------------------------------------------------------------------------
# multipart uploads: a failed part is aborted, never completed


MULTIPART = {"default_block_size": 5 * 2**20, "fixed_upload_size": True}  # s3fs: parts of 5 MiB (S3's smallest)


def _uploads_in_progress(direct, root: str) -> list:
    """The multipart uploads moto holds under ``root`` that were neither completed nor aborted."""
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    return direct.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])


def test_a_failed_part_aborts_the_upload_and_the_retry_completes_it(proxied_s3, caplog):
    proxy, root, options, direct = proxied_s3
    options = {**options, **MULTIPART}
    url, state = f"{root}/step-1", _state(7, rows=3 * 1024)  # 12 MiB: three parts
    failed = proxy.add("internal", method="PUT", path=r"/data/", query=part(2), times=1)
    caplog.set_level(logging.DEBUG, logger=STORAGE_LOG)
    skc.save(state, url, storage_options=options)
    assert failed.hits == 1
    assert [r.method for r in proxy.requests if "uploadId=" in r.query and r.method == "DELETE"] == ["DELETE"]
    assert _uploads_in_progress(direct, root) == []
    assert len(_retried_once_each(caplog, f"{url}/data/")) == 1
    assert _bitwise(_load(url, state, options), state)


def test_a_part_that_keeps_failing_leaves_no_parts_no_object_and_no_manifest(proxied_s3):
    proxy, root, options, direct = proxied_s3
    options = {**options, **MULTIPART, "shardkit": {"retries": 2, "timeout": TIMEOUT_S}}
    bucket = root.removeprefix("s3://")
    before, state = _state(8), _state(9, rows=3 * 1024)
    skc.save(before, f"{root}/step-1", storage_options=options)
    proxy.add("slowdown", method="PUT", path=r"/step-2/data/", query=part(2), times=None)
    with pytest.raises(StorageError) as info:
        skc.save(state, f"{root}/step-2", storage_options=options)
    assert str(info.value).startswith(f"writing {root}/step-2/data/")
    assert "failed after 3 attempts: OSError: [Errno 16] Please reduce your request rate. (SlowDown, HTTP 503)" in str(
        info.value)
    assert sum(r.method == "DELETE" and "uploadId=" in r.query for r in proxy.requests) == 3  # each attempt's
    assert _uploads_in_progress(direct, root) == []
    stored = direct.find(f"{bucket}/step-2/")
    assert not any(p.endswith("manifest.json") or p.endswith("-0-0.safetensors") for p in stored), stored
    assert all(_whole_safetensors(direct, p) for p in stored)  # the other, one-PUT file of the save: whole
    proxy.clear()
    assert _bitwise(_load(f"{root}/step-1", before, options), before)


# --------------------------------------------------------------------------
# waits: exponential, jittered, capped


def test_backoff_doubles_from_a_quarter_second_is_jittered_and_never_waits_over_two_seconds():
    nominal = [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    for attempt, top in enumerate(nominal, start=1):
        waits = [backoff_delay(attempt) for _ in range(200)]
        assert all(top / 2 <= w <= top for w in waits), (attempt, min(waits), max(waits))
        assert len(set(waits)) > 100  # jittered
    assert BACKOFF_CAP_S == 2.0 and max(backoff_delay(a) for a in range(1, 200)) <= 2.0


def test_waits_between_attempts_on_the_wire_follow_the_schedule(proxied_s3):
    proxy, root, options, _ = proxied_s3
    storage = Storage(f"{root}/waits", _options(options, retries=4))
    storage.put_atomic("x.bin", b"x" * 100)
    proxy.add("slowdown", method="GET", path=r"/x\.bin", times=None)
    with pytest.raises(StorageError):
        storage.read_bytes("x.bin")
    at = [r.at for r in proxy.faults()]
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert len(gaps) == 4
    for gap, top in zip(gaps, [0.25, 0.5, 1.0, 2.0]):
        assert top / 2 - 0.05 <= gap <= top + 0.5, gaps


def test_interrupt_retries_ends_a_retrying_thread_at_once(proxied_s3):
    proxy, root, options, _ = proxied_s3
    storage = Storage(f"{root}/interrupted", _options(options, retries=100))
    storage.put_atomic("x.bin", b"x" * 100)
    proxy.add("slowdown", method="GET", times=None)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            storage.read_bytes("x.bin")
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)
    worker = threading.Thread(target=read)
    worker.start()
    time.sleep(1.0)
    try:
        interrupt_retries()
        start = time.monotonic()
        worker.join(5)
        assert time.monotonic() - start < 1.0 and not worker.is_alive()
    finally:
        allow_retries()
    assert isinstance(outcome[0], StorageError) and "(SlowDown, HTTP 503)" in str(outcome[0])


# --------------------------------------------------------------------------
# two ranks: a fault on one rank's file fails every rank, naming that file


def _sharded_save_outcome(url: str, options: dict) -> tuple[str, str]:
    """Save a Shard(0) tensor from every rank of the group: (the exception's class, its message), or ("", "")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    state = {"w": distribute_tensor(torch.arange(4096.0).reshape(64, 64), mesh, [Shard(0)])}
    try:
        skc.save(state, url, storage_options=options)
    except Exception as exc:  # noqa: BLE001 - handed to the test
        return type(exc).__name__, str(exc)
    return "", ""


def test_a_fault_on_one_ranks_writes_fails_every_rank_naming_the_url_and_the_last_error(proxied_s3):
    proxy, root, options, direct = proxied_s3
    url = f"{root}/step-1"
    proxy.add("slowdown", method="PUT", path=r"/data/[0-9a-f]+-1-\d+\.safetensors$", times=None)  # rank 1's only
    start = time.monotonic()
    outcomes = run_on_ranks(2, _sharded_save_outcome, url, _options(options, retries=1))
    assert time.monotonic() - start < 30
    for kind, message in outcomes:
        assert issubclass(getattr(errors, kind), StorageError), (kind, message)
        assert re.search(rf"writing {re.escape(url)}/data/[0-9a-f]+-1-\d+\.safetensors failed after 2 attempts: "
                         r"OSError: \[Errno 16\] Please reduce your request rate\. \(SlowDown, HTTP 503\)",
                         message), message
    assert not direct.exists(url.removeprefix("s3://") + "/manifest.json")


def test_a_managed_save_that_fails_on_storage_leaves_the_latest_step_the_one_before(proxied_s3):
    proxy, root, options, _ = proxied_s3
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    manager = skc.CheckpointManager(f"{root}/run", storage_options=_options(options, retries=1))
    manager.save(1, model)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    proxy.add("internal", method="PUT", path=r"/step-0*2/", times=None)
    with pytest.raises(StorageError) as info:
        manager.save(2, model)
    assert "failed after 2 attempts" in str(info.value) and "(InternalError, HTTP 500)" in str(info.value)
    proxy.clear()
    assert manager.steps() == [1]
    fresh = torch.nn.Linear(32, 16)
    assert manager.load_latest(fresh)[0] == 1
    assert _bitwise(fresh.state_dict(), saved)


def test_a_top_level_retries_sets_shardkits_storage_option_and_a_different_one_inside_is_refused():
    assert with_retries(None, None) is None
    assert with_retries({"anon": True}, 7) == {"anon": True, "shardkit": {"retries": 7}}
    assert with_retries({"shardkit": {"timeout": 2, "retries": 7}}, 7) == {"shardkit": {"timeout": 2, "retries": 7}}
    assert Storage("memory://retries-top-level", with_retries({}, 0)).cloud.retries == 0
    with pytest.raises(ConfigurationError) as info:
        with_retries({"shardkit": {"retries": 2}}, 5)
    assert str(info.value) == "retries=5 and storage option shardkit.retries=2 disagree; give one of them"


def test_retries_on_save_load_and_the_manager_bounds_the_attempts_on_the_wire(proxied_s3, tmp_path):
    """``retries=`` on ``save``, ``load`` and ``CheckpointManager`` is the storage option: with 0 a throttled
    write fails at its first answer; with 1 the same fault is retried once and the step loads bitwise."""
    proxy, root, through, _ = proxied_s3
    options = {k: v for k, v in through.items() if k != "shardkit"}
    state = _state(3)
    proxy.add("slowdown", method="PUT", path=r"/data/", times=1)
    with pytest.raises(StorageError, match="SlowDown"):
        skc.save(state, f"{root}/no-retries", storage_options=options, retries=0)
    proxy.clear()
    proxy.add("slowdown", method="PUT", path=r"/data/", times=1)
    skc.save(state, f"{root}/one-retry", storage_options=options, retries=1)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    proxy.add("slowdown", method="GET", path=r"/data/", times=1)
    skc.load(target, f"{root}/one-retry", storage_options=options, retries=1)
    assert _bitwise(target, state)
    manager = skc.CheckpointManager(f"{root}/managed", storage_options=options, retries=0)
    assert manager.storage_options["shardkit"] == {"retries": 0}
