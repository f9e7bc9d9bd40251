"""Every user-facing failure in shardkit, in one place.

A user who catches ``ShardkitError`` catches everything shardkit raises on
purpose; anything else escaping is a bug.  Messages name the key, file, URL or
argument at fault and say what to do next, because the person reading them is
often looking at a log from a job that died hours ago.

The families mirror the two halves of the project:

* ``ShardingError`` and its children: misuse of ``fully_shard`` and the FSDP1
  surface (a bad mesh, a module sharded twice, a parameter that cannot be
  sharded, a call in the wrong training state).
* ``CheckpointError`` and its children: anything about saving, loading,
  converting or verifying a checkpoint.
* ``DataStateError`` and its child: resumable input state (``shardkit.data``:
  the sampler's position, stateful objects, RNG) that cannot be captured or
  restored as asked.

Several classes also derive from the built-in exception a Python user would
reach for (``ValueError``, ``FileNotFoundError``, ``FileExistsError``), so
code written against the standard library keeps working.  Where shardkit
offers a torch API under torch's name, an error torch raises for the same
input is also an instance of torch's builtin (``AssertionError``,
``NotImplementedError``, ...), and its message starts with torch's wording:
code that catches what ``torch.distributed.fsdp.fully_shard`` raises catches
shardkit's error too, and a search for torch's message finds it.
"""

from __future__ import annotations

import builtins
import sys

__all__ = [
    "ShardkitError",
    "ConfigurationError",
    "ShardingError",
    "AlreadyShardedError",
    "ShardedTwiceError",
    "UnsupportedMeshError",
    "UnnamedMeshDimsError",
    "UnshardableParameterError",
    "UnsupportedParameterLayoutError",
    "InvalidShardDimError",
    "ReplacedParameterError",
    "TrainingStateError",
    "DeepcopyUnsupportedError",
    "UnsupportedShardingError",
    "ComposableConflictError",
    "CollectiveError",
    "CollectiveMismatchError",
    "UnsupportedBackendError",
    "ArgumentTypeError",
    "ConflictingSettingError",
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointExists",
    "CorruptCheckpoint",
    "UnknownReferences",
    "ChecksumMismatch",
    "InvalidManifest",
    "UnsafeCheckpoint",
    "UnsupportedVersion",
    "UnsupportedFormat",
    "IncompatibleStateDict",
    "StorageError",
    "MissingCredentials",
    "BucketNotFound",
    "EndpointUnreachable",
    "CheckpointTimeout",
    "PeerLost",
    "DataStateError",
    "PerRankStateError",
    "IntegrationUnavailable",
    "error_record",
    "from_record",
    "checkpoint_error_kind",
]


class ShardkitError(Exception):
    """Base of every error shardkit raises on purpose.

    ``partly_written``: the tensor keys a failed ``load`` may have partly written (the failure came
    after it began writing its targets); empty when the failure left every target as it was.
    """

    partly_written: tuple[str, ...] = ()


class ConfigurationError(ShardkitError, ValueError):
    """An argument, option or policy value that cannot be honoured."""


# --------------------------------------------------------------------------
# The sharding core


class ShardingError(ShardkitError):
    """``fully_shard`` or the FSDP1 surface was used in a way that cannot work."""


class AlreadyShardedError(ShardingError, ValueError):
    """``fully_shard`` was applied twice to the same module."""


class ShardedTwiceError(AlreadyShardedError, AssertionError):
    """``fully_shard`` was applied twice to the same module; also an
    ``AssertionError``, which torch's composable-API contract raises."""


class UnsupportedMeshError(ShardingError, ValueError):
    """The device mesh has a shape or device that sharding cannot use (e.g. 3-D)."""


class UnnamedMeshDimsError(UnsupportedMeshError, AssertionError):
    """A 2-D (HSDP) mesh without ``mesh_dim_names``: which dim replicates and
    which shards must be named.  Also an ``AssertionError``, as torch's."""


class UnshardableParameterError(ShardingError, ValueError):
    """A parameter cannot be sharded as asked: a scalar, a non-contiguous
    tensor, a shard dim that does not divide evenly, or a parameter owned by two
    groups."""


class UnsupportedParameterLayoutError(UnshardableParameterError, NotImplementedError):
    """A parameter layout FSDP does not implement: a non-contiguous tensor, or
    uneven sharding on a dim other than 0.  Also a ``NotImplementedError``, as torch's."""


class InvalidShardDimError(UnshardableParameterError, AssertionError):
    """``shard_placement_fn`` named a dim the parameter does not have.  Also an
    ``AssertionError``, as torch's."""


class ReplacedParameterError(UnshardableParameterError, AttributeError, RuntimeError):
    """A parameter replaced on a sharded module (``module.w = nn.Parameter(...)``)
    by something other than a DTensor with the replaced one's mesh, placements
    and shape.  Also the ``AttributeError`` (a plain tensor) and
    ``RuntimeError`` (another layout) torch's ``fully_shard`` fails with."""


class TrainingStateError(ShardingError, RuntimeError):
    """A call arrived in a training state where it has no meaning (for example,
    ``summon_full_params`` during forward)."""


class DeepcopyUnsupportedError(TrainingStateError, AssertionError):
    """``copy.deepcopy`` of a sharded module.  Also an ``AssertionError``, as torch's."""


class UnsupportedShardingError(ShardingError, NotImplementedError):
    """A combination of ``fully_shard``/``replicate`` arguments that torch does
    not implement either (torch raises ``NotImplementedError`` for it)."""


class ComposableConflictError(AlreadyShardedError, RuntimeError):
    """``replicate()`` on a module that ``fully_shard`` already manages (torch
    raises ``RuntimeError`` for it)."""


class CollectiveError(ShardingError, RuntimeError):
    """A collective issued by the sharding runtime failed or timed out; the
    message names the FSDP group (module FQN), the collective and the pass,
    and the original error is chained as ``__cause__``."""


class CollectiveMismatchError(CollectiveError):
    """Debug mode (``SHARDKIT_DEBUG=1``): the ranks of a process group were
    about to run different collectives (another group, op, size, dtype or
    pass); raised on every rank, naming what each rank was doing."""


class UnsupportedBackendError(ShardingError, RuntimeError):
    """A setting needs a communication backend or device this process group
    does not have (for example symmetric memory, which needs NCCL on CUDA)."""


class ArgumentTypeError(ConfigurationError, TypeError):
    """An argument of the wrong type, where torch raises ``TypeError``."""


class ConflictingSettingError(ShardingError, AssertionError):
    """Two settings of a sharded module contradict each other (a custom
    all-gather, then staging buffers from the process group), or a one-group
    accessor meets several groups: where torch asserts, this is catchable as
    ``AssertionError``."""


# --------------------------------------------------------------------------
# The checkpoint subsystem


class CheckpointError(ShardkitError):
    """Anything about saving, loading, converting or verifying a checkpoint."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No committed checkpoint (no manifest) at the URL, or a file it names is missing."""


class CheckpointExists(CheckpointError, FileExistsError):
    """The destination already holds a committed checkpoint and overwriting was not asked for."""


class CorruptCheckpoint(CheckpointError):
    """Stored data does not match what the manifest promises (truncated, damaged, holes)."""


class UnknownReferences(ShardkitError):
    """A sibling checkpoint's manifest could not be read, so what it references is unknown (a dedup step's
    files are then all kept)."""


class ChecksumMismatch(CorruptCheckpoint):
    """A chunk's bytes do not match the checksum recorded when it was written."""


class InvalidManifest(CorruptCheckpoint):
    """The manifest (or a container header) is malformed, inconsistent or out of bounds."""


class UnsafeCheckpoint(CheckpointError):
    """The checkpoint asks for something shardkit refuses on principle: a path
    outside the checkpoint, or a pickled object outside the allowlist."""


class UnsupportedVersion(CheckpointError):
    """The checkpoint was written by a newer format version than this shardkit reads."""


class UnsupportedFormat(CheckpointError, ValueError):
    """The source is not a format shardkit recognises, or the conversion is not possible."""


class IncompatibleStateDict(CheckpointError, ValueError):
    """Checkpoint and target disagree: missing or unexpected keys, shapes or dtypes."""


class StorageError(CheckpointError, OSError):
    """The storage backend failed after bounded retries (timeout, full disk, permission)."""


class MissingCredentials(StorageError):
    """The object store asked for credentials and none were found; the message names the
    environment variables and storage options that provide them."""


class BucketNotFound(StorageError):
    """The bucket (S3, GCS) or container (Azure) in the URL does not exist at the endpoint."""


class EndpointUnreachable(StorageError):
    """The storage endpoint refused the connection, did not resolve, or did not answer in time."""


class CheckpointTimeout(CheckpointError, TimeoutError):
    """Ranks of a checkpoint's collective did not arrive within its deadline (a rank that died, was frozen,
    never called, or waits on slow storage).  The message names the phase, the step, the URL and the ranks
    that did not arrive; nothing was committed, and every earlier step stays loadable."""


class PeerLost(CheckpointError, ConnectionError):
    """A rank left a checkpoint's collective after every rank had arrived at it (it died: its connections
    reset), or the job's store became unreachable.  The message names the phase, the step, the URL and, where
    the survivors could tell, the ranks that are gone; nothing was committed, and every earlier step stays
    loadable."""


# --------------------------------------------------------------------------
# Resumable input state (shardkit.data)


class DataStateError(ShardkitError, ValueError):
    """Data position, a stateful object's state or RNG state cannot be captured or restored
    as asked: a saved sampler position for another dataset size or batch size, ranks that
    disagree about a global state, a value that cannot be stored without pickle."""


class PerRankStateError(DataStateError):
    """A per-rank object's state was saved at another world size and no ``reshard``
    function says how the new ranks should take it."""


# --------------------------------------------------------------------------
# Framework integrations (shardkit.integrations)


class IntegrationUnavailable(ShardkitError, ImportError):
    """A framework integration was imported without its framework installed; the message names the
    extra to install (``pip install 'shardkit[lightning]'``)."""


def error_record(exc: BaseException) -> dict[str, str]:
    """The wire form of an error sent to other ranks (JSON): its class name and message, so every
    rank can raise the same kind of error without parsing text; an ``OSError``'s errno travels too (a full
    disk is ENOSPC on every rank)."""
    record = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, OSError) and isinstance(exc.errno, int):
        record["errno"] = exc.errno  # type: ignore[assignment]
    return record


def from_record(record: dict[str, str], message: str | None = None) -> ShardkitError:
    """The error another rank reported (:func:`error_record`): the same shardkit class when it is
    one; for a built-in failure (``OSError``, ``MemoryError``, ``torch.OutOfMemoryError``, ...) a
    :class:`CheckpointError` that is also that built-in (:func:`checkpoint_error_kind`), so code that
    catches the built-in keeps working on every rank; else :class:`CheckpointError`.  ``message``
    replaces the text (e.g. to name the rank)."""
    name = str(record.get("type"))
    cls = globals().get(name)
    if not (isinstance(cls, type) and issubclass(cls, ShardkitError)):
        cls = checkpoint_error_kind(name)
    text = message if message is not None else str(record.get("message"))
    try:
        error = cls(text)
    except TypeError:  # a built-in whose constructor takes more than a message (UnicodeDecodeError)
        return CheckpointError(text)
    if isinstance(error, OSError) and isinstance(record.get("errno"), int):
        error.errno = record["errno"]  # type: ignore[assignment]
    return error


_KINDS: dict[str, type[CheckpointError]] = {}


def checkpoint_error_kind(name: str) -> type[CheckpointError]:
    """The :class:`CheckpointError` that is also the built-in exception called ``name`` (a Python builtin,
    or torch's ``OutOfMemoryError``), named ``Checkpoint<name>``; ``name`` may be that name already, as
    :func:`error_record` gives it.  :class:`CheckpointError` itself where there is no such built-in.

    Made once per name and kept, so every rank raises the same class and ``except OSError`` (or
    ``except torch.OutOfMemoryError``) catches the shared error of a failed load on each of them.
    """
    builtin_name = name.removeprefix("Checkpoint") if name.startswith("Checkpoint") else name
    if builtin_name in _KINDS:
        return _KINDS[builtin_name]
    torch = sys.modules.get("torch")
    builtin = getattr(builtins, builtin_name, None)
    if builtin is None and builtin_name == "OutOfMemoryError" and torch is not None:
        builtin = torch.OutOfMemoryError
    if not (isinstance(builtin, type) and issubclass(builtin, Exception)):
        return CheckpointError
    kind = type(f"Checkpoint{builtin_name}", (CheckpointError, builtin),
                {"__module__": __name__, "__str__": BaseException.__str__,
                 "__doc__": f"A checkpoint operation failed with ``{builtin_name}``: also that built-in."})
    _KINDS[builtin_name] = kind
    return kind


def __getattr__(name: str) -> type[CheckpointError]:
    """``Checkpoint<built-in>`` classes by name, so errors of those kinds pickle (to another process) and unpickle."""
    kind = checkpoint_error_kind(name) if name.startswith("Checkpoint") else CheckpointError
    if kind is CheckpointError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return kind
