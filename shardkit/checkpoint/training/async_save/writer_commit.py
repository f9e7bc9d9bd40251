"""Rank 0's commit of an ``async_save``, made by its writer process; how the writer writes, on both ends.

Why not on the training process's background thread: building, validating and
publishing the manifest is pure Python (thousands of chunk records decoded,
checked, encoded and parsed back), and a thread of the training process that
holds the GIL makes the training thread wait for it at every hand-over -- a
few milliseconds of it cost the step several times as much.  So rank 0's
background thread only gathers the reports as the JSON they travelled in and
hands them, undecoded, to its writer process, which commits with the same
code a synchronous save runs (:func:`~shardkit.checkpoint.training.save_commit.commit_gathered`)
at the writer's lower priority.

The plan's skeleton (keys, dtypes, shapes, layouts, tied keys) is the same
from one repeated save to the next; its JSON is kept with the plan's tensor
table, so a repeated save encodes only its values.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Collection, Mapping, Sequence

from shardkit.checkpoint.formats.compression import parse_compression
from shardkit.checkpoint.formats.dtypes import code_to_dtype, dtype_to_code
from shardkit.checkpoint.formats.native import NativeWriter, read_manifest
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.training.rank_report import report_from_json
from shardkit.checkpoint.training.save_commit import commit_gathered
from shardkit.checkpoint.training.save_options import SaveOptions
from shardkit.checkpoint.training.save_plan import SavePlan
from shardkit.errors import CheckpointError, ShardkitError, error_record

__all__ = ["CommitRequest", "serve_commit", "outcome_from_storage", "writer_fields", "native_writer", "COMMIT_KIND"]

log = logging.getLogger(__name__)

COMMIT_KIND = "commit"


def writer_fields(options: SaveOptions) -> dict[str, Any]:
    """How the writer process writes (a request's fields, JSON): the save's options its files depend on."""
    compression = options.compression
    return {"compression": None if compression is None else f"{compression.codec}:{compression.level}",
            "block_bytes": options.block_bytes, "fsync": options.fsync, "direct_io": options.direct_io,
            "column_strips": options.column_strips}


def native_writer(request: Mapping[str, Any]) -> NativeWriter:
    """The child's end of :func:`writer_fields`: a writer to the request's storage, configured as asked."""
    return NativeWriter(Storage(request["url"], request["options"]),
                        compression=parse_compression(request["compression"]), block_bytes=request["block_bytes"],
                        fsync=request["fsync"], direct_io=request["direct_io"],
                        column_strips=request["column_strips"])


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


class CommitRequest:
    """Encodes rank 0's commit requests for the writer process (one line of JSON each)."""

    def __init__(self) -> None:
        # the last plan's tensor table (held, so it is that table and not one at the same address) and its
        # skeleton's JSON: every repeated save of one plan shares the table
        self._last: tuple[Any, bytes] | None = None

    def skeleton(self, plan: SavePlan) -> bytes:
        """The plan's keys, dtypes, shapes, layouts and tied keys as JSON, encoded once per plan."""
        last = self._last
        if last is not None and last[0] is plan.tensors:
            return last[1]
        encoded = _dumps({"tensors": {k: [dtype_to_code(d), list(s)] for k, (d, s) in plan.tensors.items()},
                          "layouts": plan.layouts, "aliases": plan.aliases})
        self._last = (plan.tensors, encoded)
        return encoded

    def encode(self, storage: Storage, storage_options: Mapping[str, Any], options: SaveOptions, plan: SavePlan,
               reports: Sequence[bytes], world_size: int) -> bytes:
        """The request line: every rank's report passed on as the bytes it arrived in."""
        head = {"kind": COMMIT_KIND, "url": storage.url, "options": dict(storage_options), **writer_fields(options),
                "meta": options.meta, "overwrite": options.overwrite, "world_size": world_size,
                "values": plan.values}
        return b"".join([_dumps(head)[:-1], b',"plan":', self.skeleton(plan), b',"reports":[',
                         b",".join(reports), b"]}\n"])


def serve_commit(request: Mapping[str, Any]) -> dict[str, Any]:
    """The writer process's part: commit from the reports; the reply carries the error record or ``None``."""
    writer = native_writer(request)
    skeleton = request["plan"]
    plan = SavePlan([], {k: (code_to_dtype(code), tuple(shape)) for k, (code, shape) in skeleton["tensors"].items()},
                    dict(request["values"]), skeleton["layouts"], skeleton["aliases"])
    reports = [report_from_json(r) for r in request["reports"]]
    return {"commit_error": commit_gathered(writer.storage, writer, plan, reports, request["world_size"],
                                            request["meta"], request["overwrite"])}


def outcome_from_storage(storage: Storage, names: Collection[str], what: str) -> dict[str, str] | None:
    """The outcome of a commit whose writer process died (``what`` says how), read from the storage once the
    process is gone: ``None`` (committed) where the manifest there lists every file of this save (``names``),
    else the error record every rank raises -- and then removes its new files, which nothing references."""
    try:
        listed = set(read_manifest(storage, chunks=False).files)
    except ShardkitError:
        listed = set()
    if names and set(names) <= listed:
        log.warning("%s, after committing it", what)
        return None
    return error_record(CheckpointError(f"{what}; the manifest there does not list this save's files: nothing "
                                        f"was committed, and the next save starts a new writer"))
