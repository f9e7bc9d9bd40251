"""What a checkpoint format does for the tools, in one place: :class:`FormatHandler`.

Each format's folder provides one handler (``formats/<name>/handler.py``) and
the registry (:mod:`shardkit.checkpoint.formats`) lists them.  The offline
tools, the CLI and training ask a handler -- to detect and open a checkpoint,
to refuse what the format cannot hold, to write, to name the files it owns at
a destination, to verify -- instead of comparing format names, so a new format
is its folder and one registry line.  What differs between formats is a method
a handler overrides (``write``: one thread in order, or native's parallel,
resumable writer), not a flag a tool branches on.
"""

from __future__ import annotations

import fnmatch
import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any, Collection, Iterable

from shardkit.checkpoint.formats.base import CheckpointReader
from shardkit.checkpoint.formats.write_job import WriteJob, Written
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import UnsupportedFormat

if TYPE_CHECKING:
    import torch

__all__ = ["FormatHandler", "Tensors"]

Tensors = Iterable[tuple[str, "torch.dtype", tuple[int, ...]]]  # (fqn, dtype, shape) of what is to be written


class FormatHandler:
    """One checkpoint format: how a user and a directory name it, how it is read, and -- where
    ``writable`` -- written, replaced and verified.

    The class attributes are the format's capabilities, which the tools
    consult so that none of them has to know a format by its name.
    """

    name: str = ""
    description: str = ""
    aliases: tuple[str, ...] = ()       # other spellings a user may type (--from/--to)
    markers: tuple[str, ...] = ()       # files whose presence makes a directory this format's checkpoint
    open_options: tuple[str, ...] = ()  # keyword options its open_reader takes
    writable: bool = False
    write_options: tuple[str, ...] = ()  # options of a conversion only this format's output takes (--mesh, ...)
    single_file: bool = False   # a destination is one file, not a directory
    model_export: bool = False  # output holds model weights only, with config and tokenizer files beside
    content_pin: str | None = None       # a file whose bytes pin every byte of the checkpoint (its checksums)
    file_patterns: tuple[str, ...] = ()  # shapes of the file names its writer creates (fnmatch)
    data_folders: tuple[str, ...] = ()   # folders of a checkpoint directory its writer puts files in
    verify_shows_progress: bool = False  # verify reports the bytes it reads to the progress display

    # the import paths of the format's modules: its reader has detect(storage) and open_reader(storage,
    # **options), its writer check_tensors(tensors); a handler overrides the methods below only where it does
    # more than ask them.  Paths, imported on first use: the registry (and what asks it only for names,
    # markers and file patterns: a DST's check, a source's identity) loads no reader, so no torch
    reader_module: str | None = None
    writer_module: str | None = None

    @property
    def reader(self) -> ModuleType:
        """The format's reader module, imported now if it was not."""
        return importlib.import_module(self.reader_module)

    @property
    def writer(self) -> ModuleType | None:
        """The format's writer module (``None``: the format is read only), imported now if it was not."""
        return importlib.import_module(self.writer_module) if self.writer_module else None

    def detect(self, storage: Storage) -> bool:
        """Whether ``storage`` holds a checkpoint of this format."""
        return self.reader.detect(storage)

    def open_reader(self, storage: Storage, **options: Any) -> CheckpointReader:
        """A reader of the checkpoint at ``storage``; ``options`` are the ones named in ``open_options``."""
        return self.reader.open_reader(storage, **options)

    def check_tensors(self, tensors: Tensors) -> None:
        """Refuse, before the destination is touched, tensors this format cannot hold (dtype, name)."""
        if self.writer is None:
            raise UnsupportedFormat(f"shardkit reads {self.name} checkpoints and does not write them")
        self.writer.check_tensors(tensors)

    def write(self, storage: Storage, job: WriteJob) -> Written | None:
        """Write ``job`` at ``storage``; return what was written (``None`` in a process of a scale-out that
        leaves the commit to process 0).

        The default is the sequential writers' way: from one thread, in order,
        starting over on a rerun (their files record no checksums a rerun could
        trust); on a failure the files this run created are removed
        (``job.discard``).  In a scale-out, process 0 writes alone: the files are
        not per rank.
        """
        if job.scaleout.rank != 0:
            return None
        if job.progress:
            job.progress.start(f"{job.tool} → {self.name}", job.nbytes)
        try:
            files = self.write_files(storage, job)
        except BaseException:
            job.discard()
            raise
        if job.progress:
            job.progress.finish()
        # the sequentially written formats hold the tensor data as it is: stored bytes are tensor bytes
        return Written(files, job.nbytes, job.nbytes)

    def write_files(self, storage: Storage, job: WriteJob) -> list[str]:
        """The sequential writer: ``job``'s tensors (their boxes pulled from ``job.fetch``) and values at
        ``storage``, calling ``job.before_commit`` just before the commit; return the names written.  Never
        takes a name in ``job.avoid`` (the checkpoint being replaced still uses them until this commit)."""
        raise UnsupportedFormat(f"shardkit reads {self.name} checkpoints and does not write them")

    def resumes(self) -> bool:
        """Whether an interrupted :meth:`write` resumes on a rerun of the same command (its finished files
        kept), and so may be split over processes."""
        return False

    def holds(self, storage: Storage) -> bool:
        """Whether directory ``storage`` has one of this format's commit markers."""
        return any(storage.exists(marker) for marker in self.markers)

    def files_of(self, storage: Storage) -> set[str]:
        """The files of this format's checkpoint in directory ``storage``: what ``--overwrite`` replaces
        (removed once the new checkpoint commits)."""
        return set()

    def replacing_id(self, storage: Storage) -> str:
        """An identity of the checkpoint at ``storage`` that a resumable writer keeps apart from ("" if none)."""
        return ""

    def leftovers(self, storage: Storage) -> set[str]:
        """Files earlier runs of this writer left in ``storage`` that no reader loads (removed after a commit)."""
        return set()

    def foreign(self, storage: Storage, checkpoint_patterns: Collection[str]) -> list[str]:
        """What in directory ``storage`` no run of this writer left: every name without the shape of a
        checkpoint file (``checkpoint_patterns``)."""
        return [n for n in storage.listdir() if not any(fnmatch.fnmatchcase(n, p) for p in checkpoint_patterns)]

    def verify(self, storage: Storage, reader: Any, problems: list[str], *, workers: int,
               progress: Any) -> int | None:
        """Check the data of the checkpoint at ``storage``, open as ``reader``, appending what is wrong to
        ``problems``; return the bytes checked, or ``None`` when the format records nothing to check the data
        against (headers only, checked when it was opened)."""
        return None
