"""Steps 1 and 2 of a recovery from the hot tier (:mod:`.recover`): what copies each rank keeps, and the
step every rank can assemble from them.

Why a module of its own: these are pure functions of the node's directory and of the exchanged reports --
no collective, no target touched -- and every rank must compute the same choice from the same reports,
which is easiest to see, and to test, where nothing else happens.
"""

from __future__ import annotations

import logging
from typing import Any

from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.io.transfer_files import list_directory
from shardkit.checkpoint.training.hot.copies import checked_meta
from shardkit.checkpoint.training.hot.flat import MANIFEST_NAME, read_manifest
from shardkit.checkpoint.training.hot.nodes import NodeLayout, parse_copy_name
from shardkit.checkpoint.training.run_steps import step_of_dir
from shardkit.errors import ShardkitError

__all__ = ["hot_reports", "choose_step", "explain_unusable"]

log = logging.getLogger(__name__)


def hot_reports(layout: NodeLayout, rank: int, *,
                manifests: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Step 1 for this rank: one entry per copy it keeps (see the module docstring); each readable copy's
    manifest is kept in ``manifests`` by path, so reading the copy later does not read it again."""
    node_dir = layout.node_dir(rank)
    kept = {("rank", rank)} | {("replica", q) for q in layout.replicated_here(rank)}
    reports = []
    node = Storage(node_dir)
    for step_name in node.listdir():
        if step_of_dir(step_name) is None or not node.is_dir(step_name):
            continue
        step = node.child(step_name)
        for name in step.listdir():
            parsed = parse_copy_name(name)
            if parsed is None or (parsed.kind, parsed.rank) not in kept:
                continue
            path = step.child(name).url
            entry: dict[str, Any] = {"path": path, "holder": rank, "of": parsed.rank, "save_id": parsed.save_id}
            try:
                entry["files"] = list_directory(path, MANIFEST_NAME)  # what a fetch of it sends, listed once here
                manifest = read_manifest(path)
                hot = checked_meta(manifest["meta"], path)["hot"]
                if manifests is not None:
                    manifests[path] = manifest
                entry.update(step=hot["step"], world_size=hot["world_size"], structure=hot["structure"])
                if hot["rank"] != parsed.rank or hot["save_id"] != parsed.save_id:
                    entry["bad"] = f"its manifest says rank {hot['rank']}, save {hot['save_id']}"
            except (ShardkitError, OSError) as exc:
                entry["bad"] = str(exc)
            reports.append(entry)
    return reports


def choose_step(entries: list[dict[str, Any]], structures: list[str], world_size: int, at_least: int,
                bad: set[str]) -> tuple[int, str, dict[int, dict[str, Any]]] | None:
    """Step 2: the newest complete (step, save) and each rank's source copy, or ``None``."""
    by_save: dict[tuple[int, str], dict[int, list[dict[str, Any]]]] = {}
    for e in entries:
        if "bad" in e or e["path"] in bad or e["world_size"] != world_size or e["step"] < at_least:
            continue
        if e["structure"] != structures[e["of"]]:
            continue
        by_save.setdefault((e["step"], e["save_id"]), {}).setdefault(e["of"], []).append(e)
    for (step, save_id), held in sorted(by_save.items(), reverse=True):
        if len(held) == world_size:
            return step, save_id, {q: min(copies, key=lambda e: (e["holder"] != q, (e["holder"] - q) % world_size))
                                   for q, copies in held.items()}
    return None


def explain_unusable(entries: list[dict[str, Any]], structures: list[str], world_size: int) -> None:
    """Which copies cannot be used at all and why (rank 0 says it once for all ranks)."""
    for e in entries:
        if "bad" in e:
            log.warning("hot tier: skipping %s (kept by rank %d): %s", e["path"], e["holder"], e["bad"])
    usable = [e for e in entries if "bad" not in e]
    other = sorted({(e["step"], e["world_size"]) for e in usable if e["world_size"] != world_size})
    if other:
        log.warning("hot tier: steps %s were saved by %s ranks; this job has %d, so they are not used (a job on "
                    "another number of ranks resumes from the durable root)", ", ".join(str(s) for s, _ in other),
                    ", ".join(sorted({str(w) for _, w in other})), world_size)
    mesh = sorted({e["step"] for e in usable
                   if e["world_size"] == world_size and e["structure"] != structures[e["of"]]})
    if mesh:
        log.warning("hot tier: steps %s were saved for another layout of the model (mesh, placements or shapes); "
                    "they are not used (such a job resumes from the durable root)", ", ".join(map(str, mesh)))
