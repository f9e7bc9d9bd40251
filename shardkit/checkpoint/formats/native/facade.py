"""shardkit's own format: manifest.json + safetensors data files, every chunk checksummed (docs/format.md).

This module is the format's one face to the rest of shardkit, served by the
package's ``__init__`` on first use, each name imported from the module that defines it when it is first
asked for (so that the manifest's parser or the
journal can be imported without the reader and torch): what training (save,
load, the manager's retention and dedup) and the offline tools use of the
native format is named here, and nothing outside ``formats/`` imports the
modules behind it (``tests/project/test_architecture.py`` checks that).  The
handler, :data:`NATIVE`, is what the registry lists; its ``write`` is the
parallel, resumable writer for N ranks.
"""

from __future__ import annotations

from shardkit.lazy import lazy_exports

_HERE = __name__.rsplit(".", 1)[0]

# name -> the module of the format that defines it (imported when the name is first asked for: the byte
# passthrough"s names -- the manifest"s parser, its records, read_rows -- load neither the reader nor torch)
EXPORTS = {
    **dict.fromkeys(("NATIVE", "NativeHandler"), f"{_HERE}.handler"),
    **dict.fromkeys(("INDEXED_FROM_CHUNKS", "is_indexed"), f"{_HERE}.index"),
    **dict.fromkeys(("MANIFEST_NAME", "ChunkRecord", "FileRecord", "Manifest"), f"{_HERE}.manifest"),
    **dict.fromkeys(("DirectorySurvey", "remove_owned", "survey", "EXTRA_DIR", "extra_files"),
                    f"{_HERE}.ownership"),
    **dict.fromkeys(("NativeReader", "is_committed", "read_manifest"), f"{_HERE}.reader"),
    **dict.fromkeys(("DIGEST_ALGORITHMS", "rebase_reference"), f"{_HERE}.references"),
    **dict.fromkeys(("missing_references", "referenced_by_siblings", "references_of"), f"{_HERE}.siblings"),
    **dict.fromkeys(("Layout", "WriterSummary", "claims_of", "manifest_from_summaries", "write_index"),
                    f"{_HERE}.summaries"),
    **dict.fromkeys(("COLUMN_STRIPS", "DEFAULT_BLOCK_BYTES", "DEFAULT_CHUNK_BYTES", "NativeWriter", "WrittenFile",
                     "data_file_name", "group_into_files", "new_token"), f"{_HERE}.writer"),
    **dict.fromkeys(("parse_manifest",), f"{_HERE}.manifest_parse"),
    **dict.fromkeys(("read_rows",), f"{_HERE}.chunk_reads"),
    **dict.fromkeys(("checked_span",), f"{_HERE}.request_plans"),
    **dict.fromkeys(("check_data_file", "stored_entries"), f"{_HERE}.data_files"),
}

__all__ = sorted(EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
