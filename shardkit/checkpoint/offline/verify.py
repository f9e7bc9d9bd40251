"""``verify``: is every byte of a checkpoint there and intact?

What is checked depends on what the format records:

* shardkit (native): the manifest is parsed strictly (coverage: every tensor's
  chunks tile it, in bounds, no overlaps or holes; names stay inside), every
  data file has the recorded size, its safetensors header matches the crc32c
  the manifest records for it (where one is recorded), parses strictly and
  holds every chunk the manifest names there with its dtype, shape and byte
  range (``formats.native.headers``: what ``safe_open`` would read), and every
  crc32c block of every chunk matches (``formats.native.check_chunk``, the
  format's one checksum loop).  Files are read front to back in large ranged
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

Problems are collected, not raised one by one, so one run names all the
damage; :class:`VerifyReport` ``.ok`` is False when anything is wrong.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from shardkit.checkpoint.formats import detect_format, open_reader
from shardkit.checkpoint.formats.native.checksums import check_chunk
from shardkit.checkpoint.formats.native.headers import check_header
from shardkit.checkpoint.formats.torchsave.zip_records import check_zip_records
from shardkit.checkpoint.geometry.boxes import check_cover
from shardkit.checkpoint.io.concurrency import parallel_map
from shardkit.checkpoint.io.names import split_reference
from shardkit.checkpoint.io.storage import Storage, split_file
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
        if fmt == "shardkit":
            report.bytes_checked = _verify_native(reader, report.problems, workers, progress)
        elif fmt == "dcp":
            report.bytes_checked = _verify_dcp(reader, report.problems, progress)
        elif fmt in ("torch", "deepspeed", "trainer"):  # zip archives: every record carries a CRC-32
            files = reader.archives() if fmt != "torch" else [split_file(storage)]
            report.bytes_checked = sum(_verify_zip(folder, name, report.problems) for folder, name in files)
            for part in getattr(reader, "dcp_parts", list)():  # a Trainer's sharded model and optimizer
                report.bytes_checked += _verify_dcp(part, report.problems, None)
            if not report.bytes_checked and not report.problems:  # written without CRC-32s: nothing to check
                report.scope = "headers"
        else:  # HF: headers were validated on open; safetensors has no checksum to check the data against
            report.scope = "headers"
        try:
            reader.values()
        except ShardkitError as exc:
            report.problems.append(str(exc))
    finally:
        reader.close()
    report.problems = list(dict.fromkeys(report.problems))  # several chunks of one damaged record say the same
    report.seconds = time.monotonic() - start
    if progress and fmt in ("shardkit", "dcp"):
        progress.finish()
    return report


def _verify_native(reader: Any, problems: list[str], workers: int, progress: Progress | None) -> int:
    storage, manifest = reader.storage, reader.manifest
    by_file: dict[str, list[tuple[str, Any]]] = {name: [] for name in manifest.files}
    for fqn, t in manifest.tensors.items():
        for rec in t.chunks:
            by_file.setdefault(rec.file, []).append((fqn, rec))
    if progress:
        progress.start("verify", sum(rec.nbytes for t in manifest.tensors.values() for rec in t.chunks))

    def check(name: str) -> tuple[list[str], int]:
        found: list[str] = []
        where = storage.where(name)
        try:
            size = storage.size(name)
        except ShardkitError:
            shared = split_reference(name)
            return [f"{where}: missing" + (f"; this checkpoint references that file of {shared[0]}, whose data was "
                                           f"deleted or moved by hand" if shared else "")], 0
        want = manifest.files[name].size if name in manifest.files else None
        if want is not None and size != want:
            return [f"{where}: {size} bytes, the manifest records {want} (truncated or replaced)"], 0
        if want is not None:  # a damaged header is one problem; the chunks are still checked by their checksums
            try:
                check_header(storage, name, want, manifest.files[name].header,
                             [e for fqn, rec in by_file[name] for e in rec.stored_entries(manifest.tensors[fqn].dtype)])
            except ShardkitError as exc:
                found.append(str(exc))
        done = 0

        def count(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress.update(n)

        for fqn, rec in sorted(by_file[name], key=lambda x: x[1].start):
            bad = check_chunk(storage, rec, on_bytes=count)
            if bad is not None:
                found.append(f"{where}: chunk {list(rec.offsets)} of {fqn!r} fails its checksum (block {bad})")
        return found, done

    total = 0
    for found, done in parallel_map(check, sorted(by_file), max(1, workers)):
        problems.extend(found)
        total += done
    return total


def _verify_dcp(reader: Any, problems: list[str], progress: Progress | None) -> int:
    entries = reader.tensors()
    if progress:
        progress.start("verify", sum(c.locator.length for e in entries.values() for c in e.chunks))
    nbytes = 0
    for entry in entries.values():
        for i in range(len(entry.chunks)):
            try:
                n = reader.check_chunk(entry, i)
                nbytes += n
                if progress:
                    progress.update(n)
            except ShardkitError as exc:
                problems.append(str(exc))
    return nbytes


def _verify_zip(folder: Storage, name: str, problems: list[str]) -> int:
    try:
        return check_zip_records(folder, name, 0, folder.size(name), folder.where(name))
    except ShardkitError as exc:
        problems.append(str(exc))
        return 0
