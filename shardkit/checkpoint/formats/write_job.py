"""What a format's writer is asked to write, gathered once by the offline tools: :class:`WriteJob`.

Every handler's :meth:`~shardkit.checkpoint.formats.handler.FormatHandler.write`
takes one job and returns :class:`Written`, so ``convert`` and ``reshard`` have
one way to write any format: the format decides how (one thread in order, or
the native format's parallel, resumable writer), the job says what and where
the bytes come from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

from shardkit.checkpoint.formats.dtypes import itemsize

if TYPE_CHECKING:
    import torch

__all__ = ["WriteJob", "Written", "WriteProgress", "Scaleout", "TensorSpec", "FetchBox"]

# (output name, dtype, shape); a byte passthrough gives the dtype as its code ("F32"), and its fetch returns bytes
TensorSpec = tuple[str, "torch.dtype | str", tuple[int, ...]]
# (output name, offsets, shape): one box a writer asks ``fetch`` for
FetchBox = tuple[str, tuple[int, ...], tuple[int, ...]]


class WriteProgress(Protocol):
    """What a writer reports as it goes (the CLI's progress line implements it)."""

    def start(self, label: str, total: int) -> None: ...
    def update(self, nbytes: int) -> None: ...
    def skip(self, nbytes: int) -> None: ...
    def finish(self) -> None: ...


@dataclass(frozen=True)
class Scaleout:
    """This process's share of a write split over ``nprocs`` processes; ``agree(ok)`` is a barrier that
    returns whether every process succeeded."""

    rank: int = 0
    nprocs: int = 1
    agree: Callable[[bool], bool] | None = None


def _nothing(*_: Any) -> None:
    return None


@dataclass(frozen=True)
class WriteJob:
    """One output checkpoint: its tensors (boxes pulled from ``fetch`` just in time), values and ties, and
    the options of the formats that take them (``write_options`` of each handler names its own).

    ``selection`` is the identity of what was selected (each tensor's output name, source name, dtype and
    shape): a resumable writer derives its file names from it, so a rerun of the same command plans the same
    files.  ``avoid`` are names the checkpoint being replaced still uses until this commit.

    ``will_fetch``, when given, is told every box a resumable writer will ``fetch``, once and before the first:
    after a rerun has kept the outputs an interrupted run finished, only theirs are left, so a source
    can fetch what those need and nothing else (the byte passthrough's rerun: ``offline/passthrough.py``).
    """

    tensors: tuple[TensorSpec, ...]
    values: Mapping[str, Any]
    fetch: Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor | Any]
    will_fetch: Callable[[Sequence[FetchBox]], None] | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    tool: str = "convert"                      # the command, in progress lines and in the output's metadata
    selection: tuple[Any, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)  # the source's metadata, where the format carries it
    # sequential writers
    block_bytes: int = 1 << 20
    max_shard_size: int = 0
    avoid: frozenset[str] = frozenset()
    before_commit: Callable[[], None] = _nothing       # e.g. an HF export's config and tokenizer files
    discard: Callable[[], None] = _nothing             # what a failed write that does not resume removes
    copy_side_files: Callable[[str], Any] = _nothing   # the source's side files, into a folder of the output
    progress: WriteProgress | None = None
    # output laid out for ranks
    world_size: int = 1
    mesh: tuple[int, ...] | None = None
    compression: str | None = None
    budget: int = 1 << 30
    workers: int = 1
    source_id: str = ""                        # where the source is and what it holds (resume keeps only its data)
    replacing: str = ""                        # the identity of the checkpoint this output replaces
    scaleout: Scaleout = Scaleout()

    @property
    def nbytes(self) -> int:
        """Bytes of every output tensor, aliases included: what a sequential writer's progress counts."""
        return sum(math.prod(shape) * itemsize(dtype) for _, dtype, shape in self.tensors)

    @property
    def stored(self) -> list[TensorSpec]:
        """The tensors a format that records aliases writes: all but the aliases."""
        return [t for t in self.tensors if t[0] not in self.aliases]

    def on_bytes(self, nbytes: int) -> None:
        if self.progress is not None:
            self.progress.update(nbytes)


@dataclass(frozen=True)
class Written:
    """What a write produced: the names it wrote, the tensor bytes, the bytes they take in the files, and the
    bytes kept from an interrupted earlier run."""

    files: list[str]
    nbytes: int
    stored_bytes: int
    kept_bytes: int = 0
