"""shardkit's own format: manifest.json + safetensors data files, every chunk checksummed (docs/format.md).

This module is the format's one face to the rest of shardkit, served by the
package's ``__init__`` on first use (so that the manifest's parser or the
journal can be imported without the reader and torch): what training (save,
load, the manager's retention and dedup) and the offline tools use of the
native format is named here, and nothing outside ``formats/`` imports the
modules behind it (``tests/project/test_architecture.py`` checks that).  The
handler, :data:`NATIVE`, is what the registry lists; its ``write`` is the
parallel, resumable writer for N ranks.
"""

from shardkit.checkpoint.formats.native.handler import NATIVE, NativeHandler
from shardkit.checkpoint.formats.native.index import INDEXED_FROM_CHUNKS, is_indexed
from shardkit.checkpoint.formats.native.manifest import MANIFEST_NAME, ChunkRecord, FileRecord
from shardkit.checkpoint.formats.native.ownership import DirectorySurvey, remove_owned, survey
from shardkit.checkpoint.formats.native.reader import NativeReader, is_committed, read_manifest
from shardkit.checkpoint.formats.native.references import DIGEST_ALGORITHMS, rebase_reference
from shardkit.checkpoint.formats.native.siblings import missing_references, referenced_by_siblings, references_of
from shardkit.checkpoint.formats.native.summaries import (
    Layout,
    WriterSummary,
    claims_of,
    manifest_from_summaries,
    write_index,
)
from shardkit.checkpoint.formats.native.writer import (
    COLUMN_STRIPS,
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CHUNK_BYTES,
    NativeWriter,
    WrittenFile,
    data_file_name,
    group_into_files,
    new_token,
)

__all__ = ["NATIVE", "NativeHandler", "INDEXED_FROM_CHUNKS", "is_indexed", "MANIFEST_NAME", "ChunkRecord", "FileRecord",
           "DirectorySurvey", "remove_owned", "survey", "NativeReader", "is_committed", "read_manifest",
           "DIGEST_ALGORITHMS", "rebase_reference", "missing_references", "referenced_by_siblings", "references_of",
           "Layout", "WriterSummary", "claims_of", "manifest_from_summaries", "write_index", "COLUMN_STRIPS",
           "DEFAULT_BLOCK_BYTES", "DEFAULT_CHUNK_BYTES", "NativeWriter", "WrittenFile", "data_file_name",
           "group_into_files", "new_token"]
