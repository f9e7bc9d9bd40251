"""What a conversion wrote: :class:`ConvertResult`, the record ``reshard`` and ``convert`` return and the CLI
renders."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ConvertResult"]


@dataclass
class ConvertResult:
    """What a conversion wrote: formats, DST, counts, the files written, and the keys filters left out.

    Two sizes, never to be mixed up: ``bytes`` is the tensor data (what the
    tensors take in memory, after any dtype cast), ``stored_bytes`` what their
    chunks take in the files (smaller with zstd; ``verify`` reads and checks
    exactly these).  ``skipped_bytes`` counts tensor data kept from an
    interrupted earlier run (native output resumes).
    """

    src_format: str
    dst_format: str
    dst: str
    tensors: int
    bytes: int
    files: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    skipped_bytes: int = 0
    stored_bytes: int = 0
