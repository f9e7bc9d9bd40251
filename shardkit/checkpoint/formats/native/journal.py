"""The resume journal of the native format's resumable writer: one record per finished data file.

After each data file lands, its manifest records are written under
``.shardkit-resume/`` together with the identity of the source they were
written from.  A rerun keeps a journaled file only when that identity matches
and the file re-verifies (size, its header's crc32c and every checksum block);
anything else is written again.  The journal is removed after the commit.
"""

from __future__ import annotations

import json

from shardkit.checkpoint.formats.native.checksums import check_chunk
from shardkit.checkpoint.formats.native.headers import check_header
from shardkit.checkpoint.formats.native.ownership import RESUME_DIR
from shardkit.checkpoint.formats.native.writer import WrittenFile
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ShardkitError

__all__ = ["RESUME_DIR", "journal_name", "journal_entry", "journaled_file"]


def journal_name(data_file: str) -> str:
    """Where the record of data file ``data_file`` is journaled."""
    return f"{RESUME_DIR}/{data_file.rsplit('/', 1)[-1]}.json"


def journal_entry(wf: WrittenFile, source_id: str) -> bytes:
    """The journal record of a finished data file written from source ``source_id``."""
    return json.dumps({"source": source_id, "file": wf.to_json()}).encode()


def journaled_file(storage: Storage, data_file: str, source_id: str, check_data: bool = True) -> WrittenFile | None:
    """The journaled record of ``data_file`` if it was written from the same source (``source_id``) and
    its file is complete (and, with ``check_data``, its header and every checksum block match; a
    record without a header checksum, from an older shardkit, is not kept)."""
    journal = journal_name(data_file)
    if not storage.exists(journal):
        return None
    try:
        entry = json.loads(storage.read_bytes(journal))
        if entry.get("source") != source_id:
            return None
        wf = WrittenFile.from_json(entry["file"])
        if wf.name != data_file or storage.size(data_file) != wf.size:
            return None
        if check_data:
            if wf.header is None:  # journaled by an older shardkit: write the file again
                return None
            check_header(storage, wf.name, wf.size, wf.header, ())  # a damaged header raises: written again
            if any(check_chunk(storage, rec) is not None for _, rec in wf.chunks):
                return None
        return wf
    except (ShardkitError, ValueError, KeyError, TypeError, AttributeError):
        return None
