"""Step 3 of a save: what each rank reports once its data files are written, and rank 0's commit of it.

Small saves (fewer than :data:`~shardkit.checkpoint.formats.native.index.INDEXED_FROM_CHUNKS`
chunk records in all, counted by every rank alike) send their chunk records
to rank 0, which builds one ``manifest.json`` holding them (version 1 or 2).
Large ones commit version 3 the way that scales: each writer writes its own
index file and sends a summary (:mod:`~shardkit.checkpoint.formats.native.summaries`);
rank 0 never sees a chunk record, so its work grows with tensors plus ranks.
Either way rank 0 first checks that the ranks agree about the state they saved.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Callable, Mapping, Sequence

from shardkit.checkpoint.formats.dtypes import dtype_to_code
from shardkit.checkpoint.formats.native import (
    NativeWriter,
    WriterSummary,
    WrittenFile,
    claims_of,
    is_committed,
    manifest_from_summaries,
    write_index,
)
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.training.rank_report import FilesReport, RankReport, SummaryReport
from shardkit.checkpoint.training.save_plan import SavePlan, layout_rules
from shardkit.errors import CheckpointError, CheckpointExists, ShardkitError, error_record

log = logging.getLogger(__name__)

__all__ = ["state_digest", "summary_of", "commit_gathered"]


def state_digest(plan: SavePlan) -> str:
    """A digest of what every rank must agree on: each tensor's key, dtype and shape, the tied keys and
    the layouts.  Sent instead of the tensors themselves, which would make rank 0's part grow with
    tensors times ranks."""
    described = [sorted((k, dtype_to_code(d), list(s)) for k, (d, s) in plan.tensors.items()),
                 sorted(plan.aliases.items()), plan.layouts]
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def summary_of(storage: Storage, plan: SavePlan, rank: int, token: str, files: Sequence[WrittenFile]
               ) -> tuple[WriterSummary, list[str]]:
    """This writer's part of a version-3 save: its index file written (when it stored anything), and the
    summary rank 0 commits from; with the names of the files it wrote."""
    regions = {k: tuple(boxes) for k, boxes in plan.regions.items()}
    claims, listed = claims_of(layout_rules(plan.layouts), plan.coords,
                               {k: s for k, (_, s) in plan.tensors.items()}, regions)
    if not files:
        return WriterSummary(rank, None, None, {}, claims, listed), []
    name, record = write_index(storage, token, rank, files, regions)
    return WriterSummary(rank, name, record, {f.name: f.size for f in files}, claims, listed), [name]


def commit_gathered(storage: Storage, writer: NativeWriter, plan: SavePlan | None, reports: Sequence[RankReport],
                    world_size: int, meta: Mapping[str, Any] | None, overwrite: bool) -> dict[str, str] | None:
    """On rank 0 (or its async writer process): build, validate and publish the manifest from every rank's
    report; return an error record or ``None``."""
    failed = [(r, report.error) for r, report in enumerate(reports) if report.error is not None]
    if failed:
        rank, record = failed[0]
        return {**record, "message": f"save to {storage.url} failed on rank {rank}: "
                f"{record['type']}: {record['message']}; nothing was committed"}
    try:
        _publish(storage, writer, plan, reports, world_size, meta, overwrite)
        return None
    except Exception as exc:  # noqa: BLE001 - turned into a record every rank raises
        if not isinstance(exc, ShardkitError):
            exc = CheckpointError(f"save to {storage.url} could not commit: {type(exc).__name__}: {exc}")
        return error_record(exc)


Commit = Callable[[], None]


def _from_files(storage: Storage, writer: NativeWriter, plan: SavePlan, reports: Sequence[FilesReport],
                writer_info: dict[str, Any], meta: Mapping[str, Any] | None) -> Commit:
    """A small save: every rank's chunk records in one manifest, once the ranks agree on every tensor."""
    tensors = dict(plan.tensors)
    for report in reports:
        for key, (dtype, shape) in report.dtypes_and_shapes().items():
            seen = tensors.setdefault(key, (dtype, shape))
            if (seen[0], tuple(seen[1])) != (dtype, shape):
                raise CheckpointError(f"save to {storage.url}: ranks disagree about {key!r}: {seen[0]} "
                                      f"{list(seen[1])} vs {dtype_to_code(dtype)} {list(shape)}")
    _check_aliases(storage, plan, reports)
    files = [f for report in reports for f in report.files]
    manifest = writer.build_manifest(tensors, files, values=plan.values, meta=meta, writer_info=writer_info,
                                     aliases=plan.aliases)
    return lambda: writer.commit(manifest)


def _from_summaries(storage: Storage, writer: NativeWriter, plan: SavePlan, reports: Sequence[SummaryReport],
                    writer_info: dict[str, Any], meta: Mapping[str, Any] | None) -> Commit:
    """A version-3 save: the manifest from the writers' summaries, once every rank's state digest is rank 0's."""
    _check_aliases(storage, plan, reports)
    digest = state_digest(plan)
    differ = next((r for r, report in enumerate(reports) if report.digest != digest), None)
    if differ is not None:
        raise CheckpointError(f"save to {storage.url}: ranks disagree about the tensors they save: rank "
                              f"{differ}'s keys, dtypes, shapes or layouts differ from rank 0's; every rank "
                              f"must save the same state dict")
    summaries = [report.summary for report in reports]
    if any(summary is None for summary in summaries):
        raise CheckpointError(f"save to {storage.url}: a rank sent no summary of what it wrote")
    manifest, kept = manifest_from_summaries(
        {k: (dtype_to_code(d), tuple(s)) for k, (d, s) in plan.tensors.items()}, layout_rules(plan.layouts),
        summaries, values=plan.values, meta=meta, writer_info=writer_info, aliases=plan.aliases,
        where=f"save to {storage.url}")
    return lambda: writer.commit_indexed(manifest, kept)


_BUILDERS: dict[type, Callable[..., Commit]] = {FilesReport: _from_files, SummaryReport: _from_summaries}


def _check_aliases(storage: Storage, plan: SavePlan, reports: Sequence[RankReport]) -> None:
    for r, report in enumerate(reports):
        if report.aliases != plan.aliases:
            raise CheckpointError(f"save to {storage.url}: ranks disagree about tied tensors: rank 0 has "
                                  f"{plan.aliases}, rank {r} {dict(report.aliases)}; every rank must tie the same "
                                  f"keys")


def _publish(storage: Storage, writer: NativeWriter, plan: SavePlan | None, reports: Sequence[RankReport],
             world_size: int, meta: Mapping[str, Any] | None, overwrite: bool) -> None:
    """Rank 0's part once every rank wrote its files: check that the ranks agree, then commit."""
    if plan is None:
        raise CheckpointError(f"save to {storage.url}: rank 0 has no plan")
    forms = {type(report) for report in reports}
    if len(forms) != 1:
        raise CheckpointError(f"save to {storage.url}: ranks reported in different forms "
                              f"({', '.join(sorted(form.kind for form in forms))}); nothing was committed")
    writer_info = {"world_size": world_size, "mesh": plan.mesh, "layouts": plan.layouts}
    commit = _BUILDERS[forms.pop()](storage, writer, plan, reports, writer_info, meta)
    if not overwrite and is_committed(storage):
        raise CheckpointExists(f"{storage.url} already holds a committed checkpoint; pass overwrite=True to "
                               f"replace it")
    commit()
    log.info("committed %s: %d files from %d ranks", storage.url, sum(r.file_count for r in reports), len(reports))
