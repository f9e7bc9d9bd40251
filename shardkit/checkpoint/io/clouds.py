"""What shardkit asks of each fsspec backend, and what the backend's failures mean.

:class:`~shardkit.checkpoint.io.storage.Storage` is the one door for bytes; this
module holds the per-backend half of its rules, so that ``storage.py`` stays
about reading and writing.

* **One retry layer.**  ``Storage.retry`` retries a failed operation itself, so
  the backend's own retries are switched off where a public option allows it:
  botocore's (``config_kwargs.retries``) and s3fs's loop around every call, for
  S3.  gcsfs (6 attempts per HTTP request) and the Azure SDK retry inside
  themselves with no option to stop them; on ``gs://`` and ``az://`` shardkit
  therefore adds no retries of its own unless asked to.
* **Short timeouts.**  ``timeout`` (default 8 s) is how long one request may
  wait for an answer; connecting may take half of it.
* **An endpoint that never answered is not retried.**  A refused connection, a
  name that does not resolve or a request left unanswered, on an endpoint that
  has not answered anything yet in this process, is a wrong endpoint or a down
  network: it fails at once.  Once the endpoint has answered, the same failures
  are transient and retried.
* **Failures are sorted** (:func:`classify`) into the errors of
  :mod:`shardkit.errors`, each one line naming the URL, bucket or endpoint and
  what to set.

shardkit's own settings travel inside ``storage_options`` under the key
``"shardkit"`` (``{"shardkit": {"retries": 5, "timeout": 30}}``; on the command
line ``--retries``/``--timeout``) and are never handed to fsspec.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any, Mapping

from shardkit.errors import (
    BucketNotFound,
    ConfigurationError,
    EndpointUnreachable,
    MissingCredentials,
    ShardkitError,
    StorageError,
)

__all__ = ["OWN_KEY", "DEFAULT_RETRIES", "DEFAULT_TIMEOUT_S", "CloudProfile", "Failure", "classify"]

OWN_KEY = "shardkit"
DEFAULT_RETRIES = 3
DEFAULT_TIMEOUT_S = 8.0

_S3, _GCS, _AZURE = ("s3", "s3a"), ("gs", "gcs"), ("az", "abfs", "abfss")
_RETRY_INSIDE = _GCS + _AZURE  # their SDKs retry every request and offer no option to stop it

_PROVIDER = {**dict.fromkeys(_S3, ("S3", "bucket")), **dict.fromkeys(_GCS, ("GCS", "bucket")),
             **dict.fromkeys(_AZURE, ("Azure Blob", "container"))}
_DEFAULT_ENDPOINT = dict.fromkeys(_GCS, "https://storage.googleapis.com")
_CREDENTIALS_HELP = {
    **dict.fromkeys(_S3, "no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                         "AWS_PROFILE), or pass the storage options key and secret (anon=true for a public bucket)"),
    **dict.fromkeys(_GCS, "no Google Cloud credentials found; set GOOGLE_APPLICATION_CREDENTIALS to a key file "
                          "(or run gcloud auth application-default login), or pass the storage option token "
                          "(token=anon for a public bucket)"),
    **dict.fromkeys(_AZURE, "no Azure credentials found; set AZURE_STORAGE_CONNECTION_STRING, or "
                            "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY, or pass the storage options "
                            "connection_string, or account_name and account_key"),
}
_ENDPOINT_HELP = {
    **dict.fromkeys(_S3, "check AWS_ENDPOINT_URL (or the storage option client_kwargs.endpoint_url)"),
    **dict.fromkeys(_GCS, "check the storage option endpoint_url (or STORAGE_EMULATOR_HOST)"),
    **dict.fromkeys(_AZURE, "check the BlobEndpoint of the connection string (or account_name)"),
}

# Failures are recognised by class name anywhere in the exception's chain, so that no backend has to be
# importable for the others to work (botocore, aiohttp, google.auth and azure.core name them).
_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError",
                "CredentialUnavailableError"}
_NOT_FOUND = {"ResourceNotFoundError", "NoSuchBucket", "NoSuchKey"}  # wrapped by the backend in another error
_DENIED = {"PermissionError", "ClientAuthenticationError"}
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectTimeout", "ClientConnectorError",
                "ConnectionTimeoutError", "ServiceRequestError", "ConnectionRefusedError", "gaierror",
                "NameResolutionError", "ProxyConnectionError"}
_NO_ANSWER = {"ReadTimeoutError", "ReadTimeout", "ServerTimeoutError", "ServiceResponseTimeoutError",
              "FSTimeoutError", "TimeoutError"}
_CUT_SHORT = {"ServerDisconnectedError", "ClientPayloadError", "IncompleteReadError", "ResponseStreamingError",
              "ConnectionClosedError"}
_NO_DNS = {"gaierror", "ClientConnectorDNSError", "NameResolutionError"}
_CONNECT_TIMEOUT = {"ConnectTimeoutError", "ConnectTimeout", "ConnectionTimeoutError", "ServiceRequestTimeoutError"}
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
_FATAL = (IsADirectoryError, ValueError, TypeError, MemoryError)
_ANSWERED: set[str] = set()       # endpoints that answered a request in this process
_BUCKETS: set[tuple[str, str]] = set()  # (endpoint, bucket) seen to exist, or not ours to look at


@dataclass(frozen=True)
class Failure:
    """What a backend exception means: ``kind`` is one of credentials, not_found, denied, unreachable,
    no_answer, full, fatal, transient; ``detail`` is the exception in one line."""
    kind: str
    detail: str
    reason: str = ""


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(out) < 10 and all(cur is not e for e in out):
        out.append(cur)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return out


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _service_code(chain: list[BaseException]) -> str:
    """The object store's own name for the error and its HTTP status (``"SlowDown, HTTP 503"``), from the
    botocore error in the chain (s3fs re-raises it as an ``OSError`` that keeps only the message)."""
    for e in chain:
        response = getattr(e, "response", None)
        if isinstance(response, Mapping) and isinstance(response.get("Error"), Mapping):
            code = response["Error"].get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code:
                return f"{code}, HTTP {status}" if status else str(code)
    return ""


def classify(exc: BaseException) -> Failure:
    """Sort ``exc`` (whatever fsspec or the backend raised) into a :class:`Failure`."""
    chain = _chain(exc)
    names = set().union(*({c.__name__ for c in type(e).__mro__} for e in chain))
    detail = _one_line(exc)
    if (code := _service_code(chain)) and code.split(",")[0] not in detail:
        detail = f"{detail} ({code})"
    elif code:
        detail = f"{detail} (HTTP {code.partition('HTTP ')[2]})" if "HTTP " in code else detail
    if names & _CREDENTIALS:
        return Failure("credentials", detail)
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)) or names & _NOT_FOUND:
        return Failure("not_found", detail)
    if names & _DENIED or (isinstance(exc, OSError) and str(exc).startswith("Forbidden")):
        return Failure("denied", detail)
    # A connection the server reset or closed mid-answer is transient (botocore reports a reset as
    # "Could not connect", which would read as a wrong endpoint): name what really happened.
    if broken := [e for e in chain if type(e).__name__ in _CUT_SHORT or (
            isinstance(e, OSError) and e.errno in (errno.ECONNRESET, errno.EPIPE))]:
        cause = broken[-1]
        return Failure("transient", "ServerDisconnectedError: the server closed the connection before its answer "
                       "was complete" if type(cause).__name__ == "ServerDisconnectedError" else _one_line(cause))
    if names & _UNREACHABLE or any(isinstance(e, OSError) and e.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH,
                                                                             errno.ENETUNREACH) for e in chain):
        if names & _NO_DNS:
            reason = "the host name does not resolve"
        elif any(isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED
                 for e in chain):
            reason = "connection refused"
        elif names & _CONNECT_TIMEOUT:
            reason = "no connection in time"
        else:
            reason = detail
        return Failure("unreachable", detail, reason)
    if names & _NO_ANSWER:
        return Failure("no_answer", detail)
    if isinstance(exc, OSError) and exc.errno in _FULL:
        return Failure("full", detail)
    if isinstance(exc, _FATAL):
        return Failure("fatal", detail)
    return Failure("transient", detail)


def _settings(own: Any, protocol: str) -> tuple[int, float]:
    if not isinstance(own, Mapping):
        raise ConfigurationError(f"storage option {OWN_KEY!r} must be an object like "
                                 f"{{'retries': 3, 'timeout': 8}}, got {own!r}")
    unknown = sorted(set(own) - {"retries", "timeout"})
    if unknown:
        raise ConfigurationError(f"unknown storage option {OWN_KEY}.{unknown[0]}; shardkit's own options are "
                                 f"{OWN_KEY}.retries and {OWN_KEY}.timeout")
    retries = own.get("retries", 0 if protocol in _RETRY_INSIDE else DEFAULT_RETRIES)
    timeout = own.get("timeout", DEFAULT_TIMEOUT_S)
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
        raise ConfigurationError(f"storage option {OWN_KEY}.retries must be a whole number from 0 to 100, "
                                 f"got {retries!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigurationError(f"storage option {OWN_KEY}.timeout must be a number of seconds above 0, "
                                 f"got {timeout!r}")
    return retries, float(timeout)


def one_client(fs: Any) -> None:
    """Make an s3fs filesystem keep the client it made until that client's connections are closed.

    s3fs makes its client anew whenever all of the client's HTTP sessions are closed -- and a client that
    has sent nothing yet has none, which counts as all closed.  So every request begun before the first
    one got its session made a client of its own: a conversion's opening requests (SRC's and DST's
    checks, the head start's listing and first blocks, all at once) made five or six, each a botocore
    service model and a TLS context, 0.05-0.25 s of CPU apiece, taken from the transfer.  Here a client
    that has no session yet is kept, and requests that find none wait for the one being made.  Any other
    filesystem is left as it is."""
    make = getattr(fs, "set_session", None)
    if make is None or not hasattr(fs, "_s3") or getattr(fs, "shardkit_one_client", False):
        return
    import asyncio

    lock = asyncio.Lock()  # bound to the filesystem's loop at first use

    def made() -> Any:
        client = getattr(fs, "_s3", None)
        http = getattr(getattr(client, "_endpoint", None), "http_session", None)
        sessions = getattr(http, "_sessions", None)
        if client is None or sessions is None or (sessions and all(s.closed for s in sessions.values())):
            return None  # none yet, or s3fs's own test for a client to replace holds
        return client

    async def set_session(refresh: bool = False, kwargs: Mapping[str, Any] | None = None) -> Any:
        if not refresh and (client := made()) is not None:
            return client
        async with lock:
            if not refresh and (client := made()) is not None:
                return client
            return await make(refresh=refresh, kwargs=dict(kwargs or {}))

    fs.set_session = set_session
    fs.shardkit_one_client = True


def _endpoint(protocol: str, options: Mapping[str, Any]) -> str | None:
    """The endpoint the backend will talk to, as the user configured it; ``None`` for the provider's default."""
    if protocol in _S3:
        return (options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    if protocol in _GCS:
        return options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST")
    if protocol in _AZURE:
        conn = options.get("connection_string") or os.environ.get("AZURE_STORAGE_CONNECTION_STRING") or ""
        parts = dict(p.split("=", 1) for p in conn.split(";") if "=" in p)
        account = options.get("account_name") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
        host = options.get("account_host") or (f"{account}.blob.core.windows.net" if account else None)
        return parts.get("BlobEndpoint") or (f"https://{host}" if host else None)
    return None


@dataclass
class CloudProfile:
    """One URL's filesystem as shardkit configures and explains it."""
    protocol: str
    options: dict[str, Any]            # what fsspec gets: the user's options plus shardkit's defaults
    retries: int
    timeout: float
    endpoint: str | None = None       # None: the provider's default

    @classmethod
    def for_url(cls, protocol: str, storage_options: Mapping[str, Any]) -> "CloudProfile":
        opts = dict(storage_options)
        retries, timeout = _settings(opts.pop(OWN_KEY, {}), protocol)
        if protocol in _S3:
            cfg = dict(opts.get("config_kwargs") or {})
            cfg.setdefault("connect_timeout", timeout / 2)
            cfg.setdefault("read_timeout", timeout)
            cfg.setdefault("retries", {"total_max_attempts": 1})
            opts["config_kwargs"] = cfg
        elif protocol in _AZURE:
            opts.setdefault("connection_timeout", timeout / 2)
            opts.setdefault("read_timeout", timeout)
        return cls(protocol, opts, retries, timeout, _endpoint(protocol, opts))

    def tune(self, fs: Any) -> None:
        """Switch off what the filesystem object retries by itself (s3fs: its loop around every call), and
        keep one S3 client per filesystem (:func:`one_client`)."""
        if self.protocol in _S3 and hasattr(fs, "retries"):
            fs.retries = 1
        if self.protocol in _S3:
            one_client(fs)

    # -- what has been seen to work --------------------------------------
    @property
    def key(self) -> str:
        return f"{self.protocol}|{self.endpoint or ''}"

    @property
    def has_buckets(self) -> bool:
        return self.protocol in _PROVIDER

    def answered(self) -> None:
        _ANSWERED.add(self.key)

    def has_answered(self) -> bool:
        return self.key in _ANSWERED

    def reach(self, fs: Any, path: str, what: str) -> None:
        """Before the first write to an endpoint that has not answered yet: one small request for the
        bucket, so that a wrong endpoint, missing credentials or a missing bucket fail now and within
        ``timeout`` (a PUT with a body waits for the server's "100 Continue" with no timeout at all in
        aiohttp).  Any other answer, a refusal to show the bucket included, lets the write go ahead."""
        if not self.has_buckets or self.has_answered():
            return
        try:
            self._look_up(fs, path, what)
        except ShardkitError:
            raise
        except Exception as exc:  # noqa: BLE001 - sorted here
            failure = classify(exc)
            if failure.kind in ("credentials", "unreachable", "no_answer"):
                raise self.error(failure, what, 1) from exc
        self.answered()

    def bucket_error(self, fs: Any, path: str, what: str) -> StorageError | None:
        """:class:`~shardkit.errors.BucketNotFound` for ``what`` when the bucket (container) of ``path``
        does not exist; ``None`` when it does or that cannot be told.  Asked after something was not
        found, so that a missing bucket is named instead of a missing file."""
        if not self.has_buckets:
            return None
        try:
            self._look_up(fs, path, what)
        except BucketNotFound as exc:
            return exc
        except Exception:  # noqa: BLE001 - any other answer (no permission to look) says nothing about it
            pass
        return None

    def _look_up(self, fs: Any, path: str, what: str) -> None:
        """Ask for the bucket of ``path`` (once per process while it exists): BucketNotFound when it
        does not; the backend's own exception when the answer is something else."""
        bucket = path.split("/", 1)[0]
        if not bucket or (self.key, bucket) in _BUCKETS:
            return
        try:
            fs.invalidate_cache(bucket)
        except Exception:  # noqa: BLE001 - not every filesystem caches
            pass
        try:
            fs.info(bucket)
        except FileNotFoundError:
            _, word = _PROVIDER[self.protocol]
            raise BucketNotFound(f"{what}: {word} {bucket!r} does not exist at {self._where()}; create it or "
                                 "fix the URL") from None
        except Exception as exc:  # noqa: BLE001 - only a refusal is remembered: asking again changes nothing
            if classify(exc).kind == "denied":
                _BUCKETS.add((self.key, bucket))
            raise
        _BUCKETS.add((self.key, bucket))

    # -- messages --------------------------------------------------------
    def _where(self) -> str:
        name, _ = _PROVIDER.get(self.protocol, (self.protocol, "bucket"))
        if self.endpoint:
            return f"the {name} endpoint {self.endpoint}"
        if self.protocol in _S3:
            return "the default S3 endpoint of AWS"
        return f"the {name} endpoint {_DEFAULT_ENDPOINT.get(self.protocol, '')}".rstrip()

    def missing_credentials(self, what: str) -> StorageError:
        return MissingCredentials(f"{what}: {_CREDENTIALS_HELP.get(self.protocol, 'no credentials found')}")

    def error(self, failure: Failure, what: str, attempts: int) -> ShardkitError:
        """The error for ``failure`` of ``what`` after ``attempts`` attempts."""
        tried = f" after {attempts} attempts" if attempts > 1 else ""
        check = _ENDPOINT_HELP.get(self.protocol, "check the URL")
        if failure.kind == "credentials":
            return self.missing_credentials(what)
        if failure.kind == "denied":
            return StorageError(f"{what}: permission denied ({failure.detail}); check credentials")
        if failure.kind == "unreachable":
            return EndpointUnreachable(f"{what}: cannot reach {self._where()} ({failure.reason}){tried}; {check} "
                                       "and the network")
        if failure.kind == "no_answer":
            return EndpointUnreachable(f"{what}: {self._where()} did not answer within {self.timeout:g} s{tried}; "
                                       f"{check}, or allow more time with --timeout (storage option "
                                       f"{OWN_KEY}.timeout)")
        if failure.kind == "full":
            return StorageError(f"{what} failed: {failure.detail}")
        return StorageError(f"{what} failed{tried}: {failure.detail}")
