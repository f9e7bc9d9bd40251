"""The resume journal of the native format's resumable writer: one record per finished data file.

After each data file lands, its manifest records are written under
``.shardkit-resume/`` together with the identity of the source they were
written from and the file's change stamp as it landed (its ETag or generation
on an object store; inode and change times on a local disk).  A rerun keeps a
journaled file only when that identity matches, the file has the recorded
size and stamp, and its header matches the recorded crc32c and names the
recorded chunks; its data is not read back.  A file rewritten, truncated or
replaced after its record was journaled (a torn rewrite, a foreign file under
the name, a byte changed in place) has another stamp, so it is written again.
Where the filesystem reports no stamp (and for a record that has none), every
checksum block is read back and checked instead.  The journal is removed
after the commit.
"""

from __future__ import annotations

import json

from shardkit.checkpoint.formats.native.checksums import check_chunk
from shardkit.checkpoint.formats.native.headers import check_header
from shardkit.checkpoint.formats.native.ownership import RESUME_DIR
from shardkit.checkpoint.formats.native.writer import WrittenFile
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ShardkitError

__all__ = ["RESUME_DIR", "journal_name", "journal_entry", "journaled_file", "file_stamp"]


def journal_name(data_file: str) -> str:
    """Where the record of data file ``data_file`` is journaled."""
    return f"{RESUME_DIR}/{data_file.rsplit('/', 1)[-1]}.json"


def file_stamp(storage: Storage, name: str) -> tuple[int, str]:
    """(size, change stamp) of file ``name`` as the filesystem reports them now (the stamp is ``""``
    where it reports none)."""
    [(_, size, stamp)] = storage.child(name).listing()
    return size, stamp


def journal_entry(wf: WrittenFile, source_id: str, stamp: str = "") -> bytes:
    """The journal record of a finished data file written from source ``source_id``, whose change
    stamp was ``stamp`` once it landed (:func:`file_stamp`)."""
    return json.dumps({"source": source_id, "file": wf.to_json(), "stamp": stamp}).encode()


def journaled_file(storage: Storage, data_file: str, source_id: str, check_data: bool = True) -> WrittenFile | None:
    """The journaled record of ``data_file`` if it was written from the same source (``source_id``) and
    its file is complete (and, with ``check_data``, has the journaled change stamp and an intact
    header -- or, without a stamp, every checksum block matches; a record without a header
    checksum, from an older shardkit, is not kept)."""
    journal = journal_name(data_file)
    if not storage.exists(journal):
        return None
    try:
        entry = json.loads(storage.read_bytes(journal))
        if entry.get("source") != source_id:
            return None
        wf = WrittenFile.from_json(entry["file"])
        if wf.name != data_file:
            return None
        if not check_data:
            return wf if storage.size(data_file) == wf.size else None
        if wf.header is None:  # journaled by an older shardkit: write the file again
            return None
        size, stamp = file_stamp(storage, data_file)
        recorded = entry.get("stamp") or ""
        if size != wf.size or (recorded and stamp != recorded):
            return None  # truncated, rewritten or replaced since it was journaled
        check_header(storage, wf.name, wf.size, wf.header, ())  # a damaged header raises: written again
        if not (recorded and stamp) and any(check_chunk(storage, rec) is not None for _, rec in wf.chunks):
            return None
        return wf
    except (ShardkitError, ValueError, KeyError, TypeError, AttributeError):
        return None
