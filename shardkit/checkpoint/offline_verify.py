"""``verify``: is every byte of a checkpoint there and intact?

What is checked depends on what the format records:

* shardkit (native): every chunk's crc32c, every data file's size, and the
  manifest's coverage (each tensor's chunks tile it: in bounds, no overlaps,
  no holes).  Data is read sequentially, file by file, at disk speed.
* DCP: coverage of each tensor by its chunks, every storage range inside its
  file, every payload decodes to the recorded shape and dtype (DCP has no
  checksums).
* Hugging Face: strict header checks of every shard (no overlaps or holes,
  sizes match), index consistency.
* torch.save: the zip CRC-32 of every record.

Problems are collected, not raised one at a time, so one run names all the
damage; :func:`verify` returns a :class:`VerifyReport` whose ``ok`` is False
when anything is wrong.
"""

from __future__ import annotations

import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

from shardkit.checkpoint.offline_detect import detect_format, open_source
from shardkit.checkpoint.offline_io import open_location
from shardkit.checkpoint.offline_progress import Progress
from shardkit.checkpoint.offline_source import TensorEntry
from shardkit.errors import ShardkitError

__all__ = ["VerifyReport", "verify", "coverage_problems"]


@dataclass
class VerifyReport:
    url: str
    format: str
    problems: list[str] = field(default_factory=list)
    bytes_checked: int = 0
    seconds: float = 0.0
    tensors: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def rate(self) -> float:
        return self.bytes_checked / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "format": self.format, "ok": self.ok, "problems": self.problems,
                "bytes_checked": self.bytes_checked, "seconds": round(self.seconds, 3), "tensors": self.tensors}


def coverage_problems(entry: TensorEntry) -> list[str]:
    """Chunks of one tensor must lie in bounds and tile it exactly (no overlap, no hole)."""
    problems = []
    total = 0
    boxes = []
    for c in entry.chunks:
        if len(c.offsets) != len(entry.shape) or len(c.shape) != len(entry.shape) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.shape, entry.shape)):
            problems.append(f"{entry.fqn}: chunk at {list(c.offsets)} of shape {list(c.shape)} lies outside "
                            f"{list(entry.shape)}")
            continue
        n = 1
        for s in c.shape:
            n *= s
        total += n
        if n:
            boxes.append((c.offsets, c.shape))
    boxes.sort()
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1:]:
            if entry.shape and ob[0] >= oa[0] + sa[0]:
                break
            if all(max(x, y) < min(x + p, y + q) for x, p, y, q in zip(oa, sa, ob, sb)):
                problems.append(f"{entry.fqn}: chunks at {list(oa)} and {list(ob)} overlap")
    if not problems and total != entry.numel:
        problems.append(f"{entry.fqn}: chunks cover {total} of {entry.numel} elements (a hole)")
    return problems


def verify(src: str, *, storage_options: dict[str, Any] | None = None, workers: int = 4,
           progress: Progress | None = None) -> VerifyReport:
    """Check a checkpoint's integrity; see the module docstring for what each format allows."""
    start = time.monotonic()
    loc = open_location(src, storage_options)
    fmt = detect_format(loc)
    report = VerifyReport(src, fmt)
    try:
        source = open_source(src, storage_options, fmt)
    except ShardkitError as exc:
        report.problems.append(str(exc))
        report.seconds = time.monotonic() - start
        return report
    try:
        entries = source.tensors()
        report.tensors = len(entries)
        for entry in entries.values():
            report.problems.extend(coverage_problems(entry))
        if fmt == "shardkit":
            problems, nbytes = source.verify_data(workers=workers, progress=progress)
            report.problems.extend(problems)
            report.bytes_checked = nbytes
        elif fmt == "dcp":
            report.bytes_checked = _verify_dcp(source, entries, report.problems, progress)
        elif fmt == "torch":
            report.bytes_checked = _verify_zip(loc, report.problems)
        else:
            report.bytes_checked = sum(e.nbytes for e in entries.values())  # headers were validated on open
        try:
            source.values()
        except ShardkitError as exc:
            report.problems.append(str(exc))
    finally:
        source.close()
    report.seconds = time.monotonic() - start
    return report


def _verify_dcp(source: Any, entries: dict[str, TensorEntry], problems: list[str], progress: Progress | None) -> int:
    nbytes = 0
    if progress:
        progress.start("verify", sum(e.nbytes for e in entries.values()))
    for entry in entries.values():
        for chunk in entry.chunks:
            try:
                rows = chunk.shape[0] if chunk.shape else 1
                piece = source.read_rows(entry, chunk, 0, rows)
                nbytes += piece.numel() * piece.element_size()
                if progress:
                    progress.update(piece.numel() * piece.element_size())
            except ShardkitError as exc:
                problems.append(str(exc))
    return nbytes


def _verify_zip(loc: Any, problems: list[str]) -> int:
    nbytes = 0
    try:
        with loc.fs.open(loc.path, "rb") as f, zipfile.ZipFile(f) as zf:
            for info in zf.infolist():
                try:
                    with zf.open(info) as rec:
                        while rec.read(1 << 22):
                            pass
                    nbytes += info.file_size
                except (zipfile.BadZipFile, OSError) as exc:
                    problems.append(f"{loc.url}: record {info.filename}: {exc}")
    except (zipfile.BadZipFile, OSError) as exc:
        problems.append(f"{loc.url}: not a readable zip archive ({exc})")
    return nbytes
