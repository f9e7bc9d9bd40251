"""What in a directory shardkit can prove it wrote, and so may ever delete.

The rule of trust: nothing a user already has is deleted unless shardkit can
prove it wrote it.  Retention in :class:`~shardkit.checkpoint.training.manager.CheckpointManager`,
the cleanup after a failed offline run and the removal of a replaced checkpoint
all ask this module first, so a torch DCP ``step-4``, a Hugging Face export or
a user's notes that happen to sit under a checkpoint root are never touched.

A name is shardkit's when it has the exact shape shardkit gives its files:

* ``manifest.json`` (the commit marker) and its temporary ``manifest.json.tmp-<12 hex>``;
* ``data/<10 hex>-<writer>-<part>.safetensors`` (data files, see
  :func:`~shardkit.checkpoint.formats.native.writer.data_file_name`);
* ``index/<10 hex>-<writer>.json`` (format version 3's index files) and their temporary
  ``...json.tmp-<12 hex>``;
* ``.shardkit-resume/<data file>.json`` (the offline resume journal);
* ``extra/...`` (side files an offline convert copied), only beside shardkit
  data or a shardkit manifest.

Anything else is foreign.  A directory is an *interrupted shardkit save* when it
holds shardkit data and no manifest, and nothing foreign.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from shardkit.checkpoint.formats.native.manifest import MANIFEST_NAME
from shardkit.checkpoint.io.names import RESUME_DIR
from shardkit.checkpoint.io.storage import Storage

__all__ = ["DATA_DIR", "INDEX_DIR", "RESUME_DIR", "EXTRA_DIR", "extra_files", "DirectorySurvey", "survey",
           "is_native_file_name", "remove_owned"]

DATA_DIR = "data"
INDEX_DIR = "index"
EXTRA_DIR = "extra"
_DATA_NAME = re.compile(r"^[0-9a-f]{10}-\d{1,9}-\d{1,9}\.safetensors$")
_MANIFEST_TMP = re.compile(r"^" + re.escape(MANIFEST_NAME) + r"\.tmp-[0-9a-f]{12}$")
_JOURNAL_NAME = re.compile(r"^[0-9a-f]{10}-\d{1,9}-\d{1,9}\.safetensors\.json$")
_INDEX_NAME = re.compile(r"^[0-9a-f]{10}-\d{1,9}\.json(\.tmp-[0-9a-f]{12})?$")
_PATTERNS = {DATA_DIR: _DATA_NAME, INDEX_DIR: _INDEX_NAME, RESUME_DIR: _JOURNAL_NAME}


def extra_files(storage: Storage) -> list[str]:
    """The side files a native checkpoint carries (config.json, tokenizer files), kept under ``extra/``: what
    its reader and a byte passthrough of it copy alike."""
    return [f"{EXTRA_DIR}/{n}" for n in storage.listdir(EXTRA_DIR)]


def is_native_file_name(name: str) -> bool:
    """Whether ``name`` (relative to a checkpoint directory) has the shape of a shardkit data or index file."""
    head, _, tail = name.partition("/")
    return head in (DATA_DIR, INDEX_DIR) and bool(_PATTERNS[head].match(tail))


@dataclass
class DirectorySurvey:
    """The contents of one directory, split into what shardkit wrote and what it did not."""

    url: str
    committed: bool = False
    owned: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)

    @property
    def exists(self) -> bool:
        return bool(self.committed or self.owned or self.foreign)

    @property
    def interrupted_save(self) -> bool:
        """Shardkit data without a commit, and nothing else: safe to delete whole."""
        return not self.committed and bool(self.owned) and not self.foreign

    def describe(self, kind: str | None = None) -> str:
        """The directory in a few words: ``kind`` is the other tool whose checkpoint its foreign files make it
        (:func:`shardkit.checkpoint.formats.registry.foreign_kind`), if any."""
        if kind:
            return f"{self.url} (a {kind}, not a shardkit checkpoint)"
        if self.foreign:
            shown = ", ".join(self.foreign[:3]) + (", ..." if len(self.foreign) > 3 else "")
            return f"{self.url} (files shardkit did not write: {shown})"
        if not self.committed and self.owned:
            return f"{self.url} (an interrupted shardkit save: no {MANIFEST_NAME})"
        return self.url


def survey(storage: Storage) -> DirectorySurvey:
    """List ``storage`` (two levels: the directory, ``data/``, ``index/``, the journal and ``extra/``) and sort
    every name into shardkit's or foreign."""
    found = DirectorySurvey(storage.url)
    extra: list[str] = []
    for name in storage.listdir():
        if name == MANIFEST_NAME:
            found.committed = True
            found.owned.append(name)
        elif _MANIFEST_TMP.match(name):
            found.owned.append(name)
        elif name in (DATA_DIR, INDEX_DIR, RESUME_DIR, EXTRA_DIR) and storage.is_dir(name):
            pattern = _PATTERNS.get(name)
            for inner in storage.listdir(name):
                path = f"{name}/{inner}"
                if pattern is None:
                    extra.append(path)
                elif pattern.match(inner) and not storage.is_dir(path):
                    found.owned.append(path)
                else:
                    found.foreign.append(path)
        else:
            found.foreign.append(name)
    # Side files are shardkit's only where shardkit data or a shardkit manifest vouches for them.
    (found.owned if found.owned else found.foreign).extend(extra)
    return found


def remove_owned(storage: Storage, found: DirectorySurvey) -> None:
    """Delete what ``found`` says shardkit wrote, the commit marker first (so the directory stops
    being a checkpoint at once), then the directories it leaves empty; foreign names stay."""
    if found.committed:
        storage.delete([MANIFEST_NAME])
    files = [n for n in found.owned if n != MANIFEST_NAME]
    trees = [n for n in files if n.startswith(f"{EXTRA_DIR}/") and storage.is_dir(n)]
    storage.delete([n for n in files if n not in trees])
    for tree in trees:
        storage.delete_tree(tree)
    for sub in (DATA_DIR, INDEX_DIR, RESUME_DIR, EXTRA_DIR):
        if storage.is_dir(sub) and not storage.listdir(sub):
            storage.delete_tree(sub)
    if not found.foreign and not storage.listdir():
        storage.delete_tree()
