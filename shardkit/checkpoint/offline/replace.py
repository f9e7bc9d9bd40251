"""DST for the offline writers: refuse, replace without losing, clean up after a failure.

The rule: nothing a user already has is deleted or overwritten before its
replacement is committed.  So ``--overwrite`` works like ``save(overwrite=True)``:

1. the checkpoint already at DST is left whole and loadable while the new one
   is written *beside* it -- new files never take a name the old checkpoint
   still uses (the writers get those names as ``avoid``);
2. the new commit marker replaces the old in one atomic step (a rename on local
   disks, a single PUT on object stores): at every instant DST is either the
   old checkpoint or the new one;
3. only then are the old checkpoint's files the new one does not use removed,
   with what interrupted runs of the same writer left beside them.

A run that fails removes the files it created itself (names that were not in
DST before it started and have the shape of checkpoint files, or are the side
files it was to write beside them), never anything else; native output keeps
its complete, journaled files for the rerun to resume.

A DST directory that holds no checkpoint but other files (a user's notes, a
different project) is refused unless ``--overwrite``: writing a checkpoint
among them without a word would mix it into someone else's folder.  What an
interrupted run of the same kind left is not "other files", so reruns work:
for hf output that includes the config and tokenizer files it copies just
before its commit, when the weight files it writes first are there too (a
``config.json`` alone is someone's own).
"""

from __future__ import annotations

import fnmatch
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

from shardkit.checkpoint.formats import (
    CHECKPOINT_FILE_PATTERNS,
    CHECKPOINT_FOLDERS,
    COMMIT_MARKERS,
    FORMATS,
    FormatHandler,
    referenced_by_siblings,
)
from shardkit.checkpoint.io.storage import Storage, split_file
from shardkit.checkpoint.offline.progress import human_count
from shardkit.errors import CheckpointExists, ConfigurationError, ShardkitError

__all__ = ["Destination", "prepare_dst", "prepare_dst_meanwhile"]

log = logging.getLogger(__name__)


@dataclass
class Destination:
    """Where an offline run writes, and what was there before it.

    ``old`` names the files of the checkpoint being replaced (removed after the
    new commit); ``replacing`` identifies a native checkpoint being replaced
    (a digest of its manifest; "" when none), so native output plans file
    names that differ from the ones it still references; ``before`` is every
    name DST held when the run started, which failure cleanup never touches;
    ``leftovers`` are weight files earlier runs of the same writer left that
    no reader loads (removed after the commit too; the new files may take
    their names).
    """

    storage: Storage
    fmt: FormatHandler
    old: set[str] = field(default_factory=set)
    replacing: str = ""
    before: set[str] = field(default_factory=set)
    leftovers: set[str] = field(default_factory=set)

    @property
    def avoid(self) -> set[str]:
        """Names the new checkpoint must not write to: the old one still uses them until the commit."""
        return set(self.old)

    def remove_stale(self, written: Sequence[str]) -> None:
        """After the commit: delete the replaced checkpoint's files the new one did not write."""
        # commit markers first: a half-finished cleanup must never leave the old format detectable
        stale = sorted((self.old | self.leftovers) - set(written), key=lambda n: (n not in COMMIT_MARKERS, n))
        if not stale:
            return
        try:
            shared = referenced_by_siblings(self.storage)  # a dedup step beside this one may read them
            stale = [n for n in stale if n not in shared]
            self.storage.delete(stale)
            for folder in CHECKPOINT_FOLDERS:  # an empty local directory the old checkpoint's files were in
                if any(n.startswith(f"{folder}/") for n in stale) and not self.storage.listdir(folder):
                    self.storage.delete_tree(folder)
        except ShardkitError as exc:  # the new checkpoint is committed; leftovers are harmless (and unknown
            # references -- a damaged sibling manifest -- keep everything)
            log.warning("could not remove %s of the replaced checkpoint at %s: %s",
                        human_count(len(stale), "file"), self.storage.url, exc)
            return
        log.info("removed %s of the replaced checkpoint at %s", human_count(len(stale), "file"), self.storage.url)

    def discard_created(self, side_files: Collection[str] = ()) -> None:
        """After a failure of a non-resumable writer: delete the checkpoint files this run created, and the
        ``side_files`` it was to write beside them (config, tokenizer) that DST did not hold before -- so that
        a rerun finds DST as it was, not holding files it would take for someone else's."""
        try:
            created = sorted(n for n in _names(self.storage) - self.before
                             if n in side_files
                             or any(fnmatch.fnmatchcase(n.rsplit("/", 1)[-1], p) for p in CHECKPOINT_FILE_PATTERNS))
            if created:
                self.storage.delete(created)
                log.info("removed %s the failed run wrote at %s", human_count(len(created), "file"), self.storage.url)
        except ShardkitError as exc:
            log.warning("could not remove what the failed run wrote at %s: %s", self.storage.url, exc)


def _names(storage: Storage) -> set[str]:
    """Names directly in ``storage`` and in the folders a format keeps its data files in (native's ``data/``)."""
    names = set()
    for name in storage.listdir():
        names.add(name)
        if name in CHECKPOINT_FOLDERS:
            names |= {f"{name}/{n}" for n in storage.listdir(name)}
    return names


def _old_checkpoint(storage: Storage) -> tuple[set[str], str | None, str]:
    """The files of the checkpoint in directory ``storage`` (those the handler of the writable format whose
    commit marker is there owns), the marker among them that commits it (``None``: no checkpoint), and its
    identity for a resumable writer ("" when none)."""
    owner = next((h for h in FORMATS.values() if h.writable and not h.single_file and h.holds(storage)), None)
    if owner is None:
        return set(), None, ""
    old = owner.files_of(storage)
    return old, next((n for n in owner.markers if n in old), None), owner.replacing_id(storage)


def prepare_dst(dst: str, fmt: FormatHandler, storage_options: Mapping[str, Any] | None,
                overwrite: bool, storage: Storage | None = None) -> Destination:
    """Check DST for output in format ``fmt`` and describe what is there; nothing is deleted here.

    A DST holding a checkpoint is refused unless ``overwrite``, and so is a
    directory holding anything else that is not what an interrupted run of
    the same kind left there (a user's files would silently get a checkpoint
    written among them).  With ``overwrite`` such files are kept.  A one-file
    DST (torch.save) needs no plan: its writer renames the finished file over the old one.
    ``storage``: DST opened already with these options (its filesystem and client are used, not made again).
    """
    storage = storage if storage is not None else Storage(dst, storage_options)
    present = storage.exists()
    if present and storage.is_dir() == fmt.single_file:
        kind, want = ("a directory", "one file: name the file, e.g. DST/model.pt") if fmt.single_file else \
            ("a file", "a directory")
        raise ConfigurationError(f"{dst}: is {kind}, but {fmt.name} output is {want}")
    if not present:
        dest = Destination(storage, fmt)
    elif fmt.single_file:
        if not overwrite:
            raise CheckpointExists(f"{dst}: already holds a checkpoint ({storage.url}); pass --overwrite to "
                                   f"replace it")
        parent, name = split_file(storage)
        dest = Destination(storage, fmt, before=_names(parent))
    else:
        old, marker, replacing = _old_checkpoint(storage)
        if marker is not None and not overwrite:
            raise CheckpointExists(f"{dst}: already holds a checkpoint ({storage.where(marker)}); pass --overwrite "
                                   f"to replace it")
        if marker is None and not overwrite and (foreign := fmt.foreign(storage, CHECKPOINT_FILE_PATTERNS)):
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ConfigurationError(f"{dst}: not empty and not a checkpoint (it holds {shown}); write to a new or "
                                     "empty directory, or pass --overwrite to write the checkpoint beside those "
                                     "files (they are kept)")
        leftovers = fmt.leftovers(storage)
        dest = Destination(storage, fmt, old if marker else set(), replacing, _names(storage), leftovers)
    if not fmt.single_file:
        storage.makedirs()
    return dest


def prepare_dst_meanwhile(dst: str, fmt: FormatHandler, storage_options: Mapping[str, Any] | None,
                          overwrite: bool) -> Callable[[], Destination]:
    """:func:`prepare_dst`, begun now on a thread when DST is an object store, so that its requests (is
    DST there? what does it hold? its bucket) overlap the opening of SRC; the call returned waits for it
    and returns its :class:`Destination` or raises its error.  Its checks only read, and an object store
    has no directory to make, so DST is touched no earlier than before; an error of SRC or of the options
    is still raised first (this one surfaces only when the call is made).  Elsewhere the checks run when
    the call is made, as before (a local DST's directory is made by them).

    DST is opened here, on the calling thread, and the thread uses that one: fsspec keeps one filesystem
    per thread, so a DST opened on the thread would make a second client (on S3 a tenth of a second of
    CPU, its TLS setup, beside the one the conversion reads and writes through)."""
    storage = Storage(dst, storage_options)
    if not storage.is_object_store:
        return lambda: prepare_dst(dst, fmt, storage_options, overwrite)
    pool = ThreadPoolExecutor(1, thread_name_prefix="shardkit-dst-check")
    checked = pool.submit(prepare_dst, dst, fmt, storage_options, overwrite, storage)
    pool.shutdown(wait=False)
    return checked.result
