"""shardkit's own format (:mod:`~shardkit.checkpoint.formats.native.facade` names what the rest of shardkit uses).

The names are resolved on first use, so that importing one module of the
format (the manifest's parser, the journal) does not import the reader and
torch with it.
"""

from __future__ import annotations

from shardkit.lazy import lazy_exports

_EXPORTS = {name: f"{__name__}.facade" for name in (
    "NATIVE", "NativeHandler", "INDEXED_FROM_CHUNKS", "is_indexed", "MANIFEST_NAME", "ChunkRecord",
    "FileRecord", "DirectorySurvey", "remove_owned", "survey", "NativeReader", "is_committed",
    "read_manifest", "DIGEST_ALGORITHMS", "rebase_reference", "missing_references",
    "referenced_by_siblings", "references_of", "Layout", "WriterSummary", "claims_of",
    "manifest_from_summaries", "write_index", "COLUMN_STRIPS", "DEFAULT_BLOCK_BYTES",
    "DEFAULT_CHUNK_BYTES", "NativeWriter", "WrittenFile", "data_file_name", "group_into_files",
    "new_token",
)}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
