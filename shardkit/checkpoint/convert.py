"""Offline checkpoint tools as library calls: reshard, convert, inspect, verify, diff.

None of these needs a process group or a GPU; they run in one process
(optionally split across ranks under torchrun for ``reshard``/``convert`` to
native, see :mod:`shardkit.checkpoint.offline_scaleout`).  The ``shardkit``
command is a thin shell over them.

Every conversion is the same pipeline: open the source (format detected),
select/rename/cast the tensors (:mod:`offline_select`), then let the target
writer pull boxes of rows it is about to write from a :class:`Fetcher`, which
reads only the overlapping rows of the saved chunks.  Memory is bounded by
``max_memory`` — boxes are sized from it — not by the model.

DST safety: a DST that already holds a checkpoint is refused unless
``overwrite=True``; with it, the old commit marker is removed first, so a
failure at any point leaves DST without a manifest/index/metadata and no
reader will take it for a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from shardkit.checkpoint.offline_detect import detect_format, normalize_format, open_source
from shardkit.checkpoint.offline_diff import DiffReport, diff
from shardkit.checkpoint.offline_fetch import Fetcher
from shardkit.checkpoint.offline_io import Location, open_location, with_retries
from shardkit.checkpoint.offline_progress import Progress
from shardkit.checkpoint.offline_select import select
from shardkit.checkpoint.offline_verify import VerifyReport, verify
from shardkit.errors import CheckpointExists, ConfigurationError

__all__ = ["reshard", "convert", "inspect", "verify", "diff", "ConvertResult", "VerifyReport", "DiffReport",
           "DEFAULT_MAX_MEMORY", "parse_memory"]

DEFAULT_MAX_MEMORY = 256 * 2 ** 20
DEFAULT_WORKERS = 4
_COMMIT_MARKERS = {"shardkit": ["manifest.json"], "dcp": [".metadata"], "hf": ["model.safetensors.index.json"]}


def parse_memory(value: int | str | None) -> int:
    from shardkit.checkpoint.formats.hf import parse_size

    if value is None:
        return DEFAULT_MAX_MEMORY
    n = parse_size(value)
    if n < 16 * 2 ** 20:
        raise ConfigurationError(f"--max-memory {value!r} is below the 16 MiB minimum")
    return n


@dataclass
class ConvertResult:
    """What a conversion wrote: format, URL, counts, and names left out by filters."""

    src_format: str
    dst_format: str
    dst: str
    tensors: int
    bytes: int
    files: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    skipped_bytes: int = 0


def _existing_checkpoint(loc: Location) -> str | None:
    try:
        if not loc.exists():
            return None
        if not loc.isdir():
            return loc.url
        for names in _COMMIT_MARKERS.values():
            for name in names:
                if loc.exists(name):
                    return loc.child_url(name)
    except Exception:
        return None
    return None


def prepare_dst(dst: str, fmt: str, storage_options: dict[str, Any] | None, overwrite: bool) -> Location:
    """Refuse a DST holding a checkpoint (unless ``overwrite``); remove its commit marker first."""
    loc = open_location(dst, storage_options)
    found = _existing_checkpoint(loc)
    if found is not None:
        if not overwrite:
            raise CheckpointExists(f"{dst}: already holds a checkpoint ({found}); pass --overwrite to replace it")
        if loc.isdir():
            for names in _COMMIT_MARKERS.values():
                for name in names:
                    if loc.exists(name):
                        with_retries(loc.child_url(name), lambda n=name: loc.fs.rm_file(loc.child(n)))
        else:
            with_retries(loc.url, lambda: loc.fs.rm_file(loc.path))
    if fmt != "torch":
        with_retries(dst, lambda: loc.fs.makedirs(loc.path, exist_ok=True))
    return loc


def _block_bytes(max_memory: int, workers: int = 1) -> int:
    # a box, the piece read into it, and a serialized copy per worker fit in the budget
    return max(1 << 20, max_memory // (3 * max(1, workers)))


def convert(src: str, dst: str, *, to: str = "shardkit", only: Sequence[str] | None = None,
            exclude: Sequence[str] | None = None, rename: Sequence[str] | None = None, model_only: bool = False,
            dtype: str | None = None, max_shard_size: str | int = "5GB", compression: str | None = None,
            overwrite: bool = False, storage_options: dict[str, Any] | None = None,
            dst_storage_options: dict[str, Any] | None = None, max_memory: int | str | None = None,
            workers: int = DEFAULT_WORKERS, world_size: int | None = None, mesh: tuple[int, ...] | None = None,
            src_format: str | None = None, progress: Progress | None = None) -> ConvertResult:
    """Convert ``src`` (any supported format, detected) to ``to`` at ``dst``.

    Example::

        convert("ckpt/step-100", "hf-out", to="hf", max_shard_size="2GB")
    """
    to = normalize_format(to)
    budget = parse_memory(max_memory)
    if dst_storage_options is None:
        dst_storage_options = storage_options
    source = open_source(src, storage_options, src_format)
    try:
        sel = select(source.tensors(), source.values(), only=only, exclude=exclude, rename=rename,
                     model_only=model_only or to == "hf", dtype=dtype)
        if to == "shardkit":
            from shardkit.checkpoint.offline_native import write_native

            loc = prepare_dst(dst, to, dst_storage_options, overwrite)
            return write_native(source, sel, loc, dst_storage_options, world_size=world_size or 1, mesh=mesh,
                                compression=compression, budget=budget, workers=workers, progress=progress)
        if world_size not in (None, 1) or mesh:
            raise ConfigurationError(f"--world-size/--mesh apply to shardkit output only, not --to {to}")
        if compression:
            raise ConfigurationError(f"--compression applies to shardkit output only, not --to {to}")
        loc = prepare_dst(dst, to, dst_storage_options, overwrite)
        fetch = Fetcher(source, sel.dtype_for, sel.rename_back)
        block = _block_bytes(budget)
        on_bytes = progress.update if progress else (lambda n: None)
        if progress:
            progress.start(f"convert → {to}", sel.nbytes)
        if to == "hf":
            from shardkit.checkpoint.formats.hf import parse_size, write_hf

            files = write_hf(loc, sel.triples, fetch, block_bytes=block, max_shard_size=parse_size(max_shard_size),
                             on_bytes=on_bytes, before_index=lambda: _copy_side_files(source, loc))
        elif to == "dcp":
            from shardkit.checkpoint.formats.dcp import write_dcp

            write_dcp(loc, sel.triples, sel.values, fetch, block_bytes=block, on_bytes=on_bytes)
            files = ["__0_0.distcp", ".metadata"]
        else:
            from shardkit.checkpoint.formats.torchsave import write_torch_save

            write_torch_save(loc, sel.triples, sel.values, fetch, block_bytes=block, on_bytes=on_bytes)
            files = [loc.url]
        if progress:
            progress.finish()
        return ConvertResult(source.format, to, dst, len(sel.tensors), sel.nbytes, files, sel.dropped)
    finally:
        source.close()


def side_files_of(source: Any) -> tuple[Location | None, list[str]]:
    """Files that travel with the weights (config.json, tokenizer files): HF folders and native ``extra/``."""
    names = getattr(source, "side_files", None)
    if names:
        return source.folder, list(names)
    return None, []


def _copy_side_files(source: Any, dst: Location) -> None:
    folder, names = side_files_of(source)
    for name in names:
        data = folder.read(name)
        with_retries(dst.child_url(name), lambda: dst.fs.pipe_file(dst.child(name), data))


def reshard(src: str, dst: str, *, world_size: int | None = None, mesh: tuple[int, ...] | str | None = None,
            dtype: str | None = None, dtype_optim: bool = False, compression: str | None = None,
            only: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
            rename: Sequence[str] | None = None, model_only: bool = False, overwrite: bool = False,
            storage_options: dict[str, Any] | None = None, dst_storage_options: dict[str, Any] | None = None,
            max_memory: int | str | None = None, workers: int = DEFAULT_WORKERS,
            progress: Progress | None = None) -> ConvertResult:
    """Write ``src`` as a shardkit checkpoint laid out for ``world_size`` ranks (or a 2-D ``mesh``).

    Each rank's shards land in their own data file(s), so a job of that size
    reads exactly its files.  Optimizer state is resharded with the weights;
    ``dtype`` casts model weights only, unless ``dtype_optim``.  A rerun after
    an interruption skips data files already written and verified.

    Example::

        reshard("s3://bucket/ckpt", "s3://bucket/ckpt-ws8", world_size=8,
                storage_options={"anon": False})
    """
    from shardkit.checkpoint.offline_native import parse_mesh, write_native

    mesh_t = parse_mesh(mesh) if mesh is not None else None
    if world_size is None and mesh_t is None:
        raise ConfigurationError("reshard needs --world-size N or --mesh AxB")
    if mesh_t is not None and world_size is not None and world_size != _prod(mesh_t):
        raise ConfigurationError(f"--world-size {world_size} disagrees with --mesh {mesh} ({_prod(mesh_t)} ranks)")
    ws = world_size if world_size is not None else _prod(mesh_t)
    if ws < 1:
        raise ConfigurationError(f"--world-size must be at least 1, got {ws}")
    budget = parse_memory(max_memory)
    if dst_storage_options is None:
        dst_storage_options = storage_options
    source = open_source(src, storage_options)
    try:
        sel = select(source.tensors(), source.values(), only=only, exclude=exclude, rename=rename,
                     model_only=model_only, dtype=dtype, dtype_optim=dtype_optim)
        loc = prepare_dst(dst, "shardkit", dst_storage_options, overwrite)
        return write_native(source, sel, loc, dst_storage_options, world_size=ws, mesh=mesh_t,
                            compression=compression, budget=budget, workers=workers, progress=progress)
    finally:
        source.close()


def _prod(t: tuple[int, ...] | None) -> int:
    n = 1
    for x in t or ():
        n *= x
    return n


def inspect(src: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Describe a checkpoint: format, layout, metadata, tensors (dtype/shape/bytes/chunks), totals.

    Returns a JSON-ready dict (the CLI's ``--json`` prints it as is).
    """
    fmt = detect_format(open_location(src, storage_options))
    source = open_source(src, storage_options, fmt)
    try:
        tensors = []
        total = 0
        chunks = 0
        for name, e in sorted(source.tensors().items()):
            tensors.append({"name": name, "dtype": str(e.dtype).replace("torch.", ""), "shape": list(e.shape),
                            "bytes": e.nbytes, "chunks": len(e.chunks)})
            total += e.nbytes
            chunks += len(e.chunks)
        meta = source.meta()
        layout = getattr(source, "layout", lambda: {})()
        return {"url": src, "format": fmt, "layout": layout, "meta": meta, "values": sorted(source.values()),
                "tensors": tensors,
                "totals": {"tensors": len(tensors), "bytes": total, "chunks": chunks,
                           "model_bytes": sum(t["bytes"] for t in tensors if t["name"].startswith("model.")),
                           "optim_bytes": sum(t["bytes"] for t in tensors if t["name"].startswith("optim."))}}
    finally:
        source.close()

