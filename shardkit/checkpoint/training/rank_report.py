"""What each rank of a save reports to rank 0 once its data files are written: a :data:`RankReport`.

Two forms, one per size of save, each a frozen record with one JSON form
(sent by :meth:`~shardkit.checkpoint.io.dist.Dist.gather_json`, no pickle)
whose ``kind`` names it; :func:`report_from_json` is the one place the forms
are told apart.

- :class:`FilesReport` (a small save): the rank's data files with their chunk
  records, and the dtype and shape of every tensor it wrote chunks of.
- :class:`SummaryReport` (a save of ``INDEXED_FROM_CHUNKS`` records or more):
  the rank wrote its own index file; it sends a summary of it and a digest of
  the state it saved, never a chunk record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from shardkit.checkpoint.formats.dtypes import code_to_dtype
from shardkit.checkpoint.formats.native import WriterSummary, WrittenFile
from shardkit.errors import CheckpointError

__all__ = ["FilesReport", "SummaryReport", "RankReport", "report_from_json"]


@dataclass(frozen=True)
class FilesReport:
    """A rank's part of a small save: its files (chunk records included) and what it wrote chunks of."""

    files: tuple[WrittenFile, ...] = ()
    tensors: Mapping[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # key -> (dtype code, shape)
    aliases: Mapping[str, str] = field(default_factory=dict)
    error: dict[str, str] | None = None

    kind = "files"

    @property
    def file_count(self) -> int:
        return len(self.files)

    def dtypes_and_shapes(self) -> dict[str, tuple[Any, tuple[int, ...]]]:
        return {key: (code_to_dtype(code), tuple(shape)) for key, (code, shape) in self.tensors.items()}

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "files": [f.to_json() for f in self.files],
                "tensors": {k: [code, list(shape)] for k, (code, shape) in self.tensors.items()},
                "aliases": dict(self.aliases), "error": self.error}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "FilesReport":
        return cls(tuple(WrittenFile.from_json(f) for f in doc["files"]),
                   {k: (code, tuple(shape)) for k, (code, shape) in doc["tensors"].items()},
                   dict(doc["aliases"]), doc["error"])


@dataclass(frozen=True)
class SummaryReport:
    """A rank's part of a version-3 save: the summary of the index file it wrote, and the digest of the state
    it saved (rank 0 checks every rank's against its own)."""

    summary: WriterSummary | None = None
    digest: str = ""
    aliases: Mapping[str, str] = field(default_factory=dict)
    error: dict[str, str] | None = None

    kind = "summary"

    @property
    def file_count(self) -> int:
        return len(self.summary.files) if self.summary is not None else 0

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "summary": None if self.summary is None else self.summary.to_json(),
                "digest": self.digest, "aliases": dict(self.aliases), "error": self.error}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "SummaryReport":
        summary = doc["summary"]
        return cls(None if summary is None else WriterSummary.from_json(summary), doc["digest"],
                   dict(doc["aliases"]), doc["error"])


RankReport = Union[FilesReport, SummaryReport]

_FORMS: dict[str, type[FilesReport] | type[SummaryReport]] = {FilesReport.kind: FilesReport,
                                                               SummaryReport.kind: SummaryReport}


def report_from_json(doc: Mapping[str, Any]) -> RankReport:
    """The report a rank sent, in its form (the ``kind`` it names)."""
    form = _FORMS.get(doc.get("kind")) if isinstance(doc, Mapping) else None
    if form is None:
        raise CheckpointError(f"a rank reported its save in an unknown form: {str(doc)[:200]}")
    return form.from_json(doc)
