"""What the checkpoints beside one read from it: its files that a sibling's references name.

References (format version 4) make a checkpoint depend on files of an older
one under the same root.  Those files must outlive the step that wrote them:
retention keeps a step while a kept step references it, and a checkpoint
written again over an older one keeps the older files a sibling references.
When a sibling's shardkit manifest cannot be read, nothing it might
reference is deleted; another tool's ``manifest.json`` references nothing.
"""

from __future__ import annotations

import json
from typing import Iterable

from shardkit.checkpoint.formats.native.manifest import FORMAT_NAME, MANIFEST_NAME
from shardkit.checkpoint.formats.native.manifest_parse import parse_manifest
from shardkit.checkpoint.formats.native.reader import read_manifest
from shardkit.checkpoint.io.names import is_sibling_name, split_reference
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CheckpointNotFound, ShardkitError, UnknownReferences

__all__ = ["references_of", "referenced_by_siblings", "missing_references"]


def references_of(storage: Storage) -> tuple[str, ...]:
    """The sibling directories a committed checkpoint references (its manifest alone is read); none for a
    directory without ``manifest.json`` or whose ``manifest.json`` is another tool's JSON document."""
    try:
        data = storage.read_bytes(MANIFEST_NAME)
    except CheckpointNotFound:
        return ()
    except ShardkitError as exc:
        raise UnknownReferences(f"cannot tell what {storage.url} references: {exc}") from exc
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        doc = None  # unreadable: perhaps a damaged shardkit manifest, so unknown
    if isinstance(doc, dict) and doc.get("format") != FORMAT_NAME:
        return ()
    try:
        return parse_manifest(data, storage.where(MANIFEST_NAME)).references
    except ShardkitError as exc:
        raise UnknownReferences(f"cannot tell what {storage.url} references: {exc}") from exc


def referenced_by_siblings(storage: Storage) -> set[str]:
    """Names inside ``storage`` (``data/...``) that a committed checkpoint beside it references."""
    parent_url, _, own = storage.url.rstrip("/").rpartition("/")
    if not parent_url or parent_url.endswith(":/") or not is_sibling_name(own):
        return set()  # no reference can name this directory
    parent = Storage(parent_url, storage.storage_options)
    found: set[str] = set()
    for name in parent.listdir():
        if name == own or not is_sibling_name(name) or not parent.is_dir(name):
            continue
        sibling = parent.child(name)
        if own not in references_of(sibling):
            continue
        try:
            files = read_manifest(sibling).files
        except ShardkitError as exc:
            raise UnknownReferences(f"cannot tell which files of {storage.url} {sibling.url} references: {exc}") \
                from exc
        found |= {parts[1] for f in files if (parts := split_reference(f)) is not None and parts[0] == own}
    return found


def missing_references(storage: Storage, files: Iterable[str]) -> dict[str, list[str]]:
    """Per sibling directory, the files among ``files`` (a manifest's file names) that reference it and are
    not there: a referenced step deleted or moved by hand, so the checkpoint at ``storage`` cannot be loaded.

    One listing per referenced folder (not one request per file), so describing a checkpoint stays cheap
    on object stores.  Sizes and checksums are ``verify``'s to check.
    """
    wanted: dict[tuple[str, str], set[str]] = {}
    for name in files:
        if (parts := split_reference(name)) is not None:
            folder, _, base = parts[1].rpartition("/")
            wanted.setdefault((parts[0], folder), set()).add(base)
    parent_url = storage.url.rstrip("/").rpartition("/")[0]
    parent = Storage(parent_url, storage.storage_options) if parent_url and not parent_url.endswith(":/") else None
    missing: dict[str, list[str]] = {}
    for (sibling, folder), bases in sorted(wanted.items()):
        there = set(parent.child(sibling).listdir(folder)) if parent is not None else set()
        gone = [f"{folder}/{b}" if folder else b for b in sorted(bases - there)]
        if gone:
            missing.setdefault(sibling, []).extend(gone)
    return missing
