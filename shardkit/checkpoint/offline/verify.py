"""``verify``: is every byte of a checkpoint there and intact?

What is checked depends on what the format records:

* shardkit (native): the manifest is parsed strictly (coverage: every tensor's
  chunks tile it, in bounds, no overlaps or holes; names stay inside), every
  data file has the recorded size, its safetensors header matches the crc32c
  the manifest records for it (where one is recorded), parses strictly and
  holds every chunk the manifest names there with its dtype, shape and byte
  range (``formats.native.headers``: what ``safe_open`` would read), and every
  crc32c block of every chunk matches (``formats.native.checksums.check_chunk``,
  the format's one checksum loop).  Files are read front to back in large ranged
  reads, several files in parallel: this runs at disk speed.
* DCP: coverage of each tensor by its chunks; every payload is a torch.save
  zip archive, so each record's CRC-32 is checked by streaming it through
  ranged reads (memory of one read step, not of a chunk), and its pickled
  header must hold the recorded shape and dtype.  Payloads without a
  checksum (zstd transforms, safetensors serialization) are decoded instead.
* Hugging Face: safetensors records no checksums; strict header checks of
  every shard (dtypes, sizes, no overlaps or holes) and index consistency,
  done when the folder is opened.  The report says so (``scope="headers"``,
  ``bytes_checked=0``) rather than claiming data it never read.
* torch.save: the zip CRC-32 of every record, streamed the same way (a file
  written without CRC-32s, every one 0, gets ``scope="headers"``).
* DeepSpeed: the same for every model- and optimizer-state file of the tag;
  the partitions were checked against ``param_shapes`` when it was opened.
* Trainer/Accelerate folders: each part as its format is checked (DCP folders,
  torch.save files, RNG and scheduler files); safetensors weights by headers.

Each format's handler does its part of the checking (``formats/<name>/handler.py``:
``FormatHandler.verify``); coverage is checked here for all of them.

Problems are collected, not raised one by one, so one run names all the
damage; :class:`VerifyReport` ``.ok`` is False when anything is wrong.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from shardkit.checkpoint.formats import FORMATS, detect_format, open_reader
from shardkit.checkpoint.geometry.boxes import check_cover
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.offline.progress import Progress
from shardkit.errors import ShardkitError

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    """Everything wrong with one checkpoint, gathered in one pass so a user sees all the damage at once.

    ``scope`` says how deep the check went, because formats differ: with
    "checksums" every stored data byte was read and checked; with "headers"
    (HF, which records no checksums) only the structure was, and
    ``bytes_checked`` is 0 rather than a figure nobody read.
    """

    url: str
    format: str
    problems: list[str] = field(default_factory=list)
    bytes_checked: int = 0
    seconds: float = 0.0
    tensors: int = 0
    scope: str = "checksums"  # "checksums": data bytes were read and checked; "headers": only the structure

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def rate(self) -> float:
        return self.bytes_checked / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "format": self.format, "ok": self.ok, "problems": self.problems,
                "bytes_checked": self.bytes_checked, "seconds": round(self.seconds, 3), "tensors": self.tensors,
                "scope": self.scope}


def verify(src: str, *, storage_options: Mapping[str, Any] | None = None, workers: int = 4,
           progress: Progress | None = None) -> VerifyReport:
    """Check a checkpoint's integrity; see the module docstring for what each format allows."""
    start = time.monotonic()
    storage = Storage(src, storage_options)
    fmt = detect_format(storage)
    report = VerifyReport(src, fmt)
    try:
        reader = open_reader(storage, format=fmt)
        entries = reader.tensors()  # a version-3 checkpoint reads its index files here
    except ShardkitError as exc:
        report.problems.append(str(exc))
        report.seconds = time.monotonic() - start
        return report
    try:
        report.tensors = len(entries)
        for fqn, entry in entries.items():
            problem = check_cover(entry.shape, [c.box for c in entry.chunks])
            if problem:
                report.problems.append(f"{fqn}: {problem}")
        checked = FORMATS[fmt].verify(storage, reader, report.problems, workers=workers, progress=progress)
        if checked is None:  # nothing recorded to check the data against: headers were checked on open
            report.scope = "headers"
        else:
            report.bytes_checked = checked
        try:
            reader.values()
        except ShardkitError as exc:
            report.problems.append(str(exc))
    finally:
        reader.close()
    report.problems = list(dict.fromkeys(report.problems))  # several chunks of one damaged record say the same
    report.seconds = time.monotonic() - start
    if progress and FORMATS[fmt].verify_shows_progress:
        progress.finish()
    return report
