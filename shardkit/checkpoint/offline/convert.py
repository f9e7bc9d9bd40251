"""Offline checkpoint tools as library calls: reshard, convert, inspect, verify, diff.

None of these needs a process group or a GPU; they run in one process
(optionally split across ranks under torchrun for ``reshard``/``convert`` to
native, see :mod:`shardkit.checkpoint.offline.scaleout`).  The ``shardkit``
command is a thin shell over them.

Every conversion is the same pipeline: open the source (format detected),
select/rename/cast the tensors (:mod:`~shardkit.checkpoint.offline.select`),
then let the target format's handler write them (one :class:`~shardkit.checkpoint.formats.write_job.WriteJob`,
one ``write``), pulling boxes of rows it is about to write from a
:class:`Fetcher`, which reads only the overlapping rows of the saved chunks.  Memory is bounded by
``max_memory`` — boxes are sized from it — not by the model.

DST safety: a DST that is SRC, lies inside it or holds it is refused (writing
would destroy what is being read).  A DST that already holds a checkpoint is
refused unless ``overwrite=True``; with it, the old checkpoint stays whole and
loadable until the new one commits beside it, then its files are removed
(:mod:`~shardkit.checkpoint.offline.replace`).  A failed run removes the files
it created.  What the target format cannot hold (a dtype, a name) is refused
before DST is touched.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Mapping, Sequence

from shardkit.checkpoint.formats import FORMATS, NATIVE, FormatHandler, open_reader, writer_for
from shardkit.checkpoint.formats.native import missing_references
from shardkit.checkpoint.formats.torchsave.reader import TorchLoadOptions
from shardkit.checkpoint.formats.write_job import Scaleout, WriteJob
from shardkit.checkpoint.io.direct_io import BUFFER_BYTES as DIRECT_BUFFER_BYTES
from shardkit.checkpoint.io.names import split_reference
from shardkit.checkpoint.offline.diff import DiffReport, diff
from shardkit.checkpoint.offline.fetch import Fetcher, read_through
from shardkit.checkpoint.offline.hf_export import HfExport, plan_hf_export
from shardkit.checkpoint.offline.options import (
    DEFAULT_MAX_MEMORY,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_WORKERS,
    parse_memory,
    parse_mesh,
    parse_size,
)
from shardkit.checkpoint.offline.progress import Progress, human_count
from shardkit.checkpoint.offline.replace import Destination, prepare_dst, prepare_dst_meanwhile
from shardkit.checkpoint.offline.result import ConvertResult
from shardkit.checkpoint.offline.select import Selection, select
from shardkit.checkpoint.offline.side_files import copy_side_files, side_files_meanwhile
from shardkit.checkpoint.offline.source import check_distinct, source_id_meanwhile
from shardkit.checkpoint.offline.verify import VerifyReport, verify
from shardkit.errors import CheckpointError, ConfigurationError

__all__ = ["reshard", "convert", "inspect", "verify", "diff", "ConvertResult", "VerifyReport", "DiffReport",
           "DEFAULT_MAX_MEMORY", "parse_memory"]

log = logging.getLogger(__name__)


def _notes(source: Any, progress: Progress | None, more: Sequence[str] = ()) -> None:
    """Tell the user about side files the source holds but the conversion leaves behind, and why
    (and ``more`` lines, e.g. tied keys an HF export leaves out)."""
    for line in getattr(source, "skipped_side_files", ()) or ():
        if progress:
            progress.note(f"note: not copied: {line}")
    for line in more:
        if progress:
            progress.note(line)


def _open_distinct(src: str, dst: str, storage_options: Mapping[str, Any] | None,
                   dst_storage_options: Mapping[str, Any] | None, src_format: str | None,
                   torch_options: TorchLoadOptions | None = None,
                   check_dst: Callable[[Any], Any] | None = None) -> tuple[Any, Any, Any]:
    """Open SRC once DST is known not to overlap it; DST's options default to SRC's.

    The overlap check comes first so that nothing is read (or, later,
    deleted) when DST would clobber SRC.  ``check_dst(dst options)``, when
    given, starts DST's check (:func:`prepare_dst_meanwhile`) before SRC is
    opened; what it returns is the third value.
    """
    if dst_storage_options is None:
        dst_storage_options = storage_options
    check_distinct(src, dst, storage_options, dst_storage_options)
    dest_of = check_dst(dst_storage_options) if check_dst else None
    return (open_reader(src, storage_options, format=src_format, torch_options=torch_options), dst_storage_options,
            dest_of)


def _block_bytes(max_memory: int) -> int:
    """Bytes per block for the sequential writers: a box, the piece read into it and the writer's
    serialized copy fit in the budget next to the writer's O_DIRECT staging buffer."""
    return max(1 << 20, (max_memory - DIRECT_BUFFER_BYTES) // 3)


def convert(src: str, dst: str, *, to: str = NATIVE.name, only: Sequence[str] | None = None,
            exclude: Sequence[str] | None = None, rename: Sequence[str] | None = None, model_only: bool = False,
            dtype: str | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
            compression: str | None = None, overwrite: bool = False, storage_options: dict[str, Any] | None = None,
            dst_storage_options: dict[str, Any] | None = None, max_memory: int | str | None = None,
            workers: int = DEFAULT_WORKERS, world_size: int | None = None, mesh: tuple[int, ...] | str | None = None,
            src_format: str | None = None, progress: Progress | None = None,
            config: str | None = None, trust_pickle: bool = False,
            model_keys: Sequence[str] | None = None) -> ConvertResult:
    """Convert ``src`` (any supported format, detected) to ``to`` at ``dst``.

    ``to="shardkit"`` writes a native checkpoint (``world_size``/``mesh``, as
    :func:`reshard`), resumable and written by ``workers`` threads; ``hf``,
    ``torch`` and ``dcp`` output is written sequentially and starts over when
    rerun.  Options are checked, and unsupported tensors refused, before DST is
    touched.  ``config`` (``hf`` only): a ``config.json`` or a directory whose
    config, tokenizer and generation files go beside the weights; tied weights
    and ``--dtype`` are then written the way ``from_pretrained`` reads them
    (see :mod:`~shardkit.checkpoint.offline.hf_export`).
    A torch.save SRC: ``trust_pickle=True`` unpickles it without the
    ``weights_only`` allowlist -- UNSAFE, it runs any code the file names; only
    for files you trust; ``model_keys`` (parameter FQNs in
    ``named_parameters()`` order) names optimizer state keyed by number
    (:mod:`~shardkit.checkpoint.formats.torchsave.state`).

    Example::

        convert("ckpt/step-100", "hf-out", to="hf", max_shard_size="2GB", config="llama-3.2-1b/")
    """
    target = writer_for(to)
    to = target.name
    budget = parse_memory(max_memory)
    shard_cap = parse_size(max_shard_size, "--max-shard-size")
    for option, value in (("world_size", world_size not in (None, 1)), ("mesh", mesh), ("compression", compression),
                          ("config", config is not None)):
        if value and option not in target.write_options:
            flag = "--world-size/--mesh" if option in ("world_size", "mesh") else f"--{option}"
            raise ConfigurationError(f"{flag} {'apply' if '/' in flag else 'applies'} to {_formats_taking(option)} "
                                     f"output only, not --to {to}")
    source, dst_storage_options, dest_of = _open_distinct(
        src, dst, storage_options, dst_storage_options, src_format,
        TorchLoadOptions(trust_pickle, _keys(model_keys), need_names=not (model_only or target.model_export)),
        lambda options: prepare_dst_meanwhile(dst, target, options, overwrite))
    try:
        pin = source_id_meanwhile(src, storage_options, source)
        sel = select(source.tensors(), source.values(), only=only, exclude=exclude, rename=rename,
                     model_only=model_only or target.model_export, dtype=dtype, aliases=source.aliases())
        target.check_tensors(sel.triples)
        export = plan_hf_export(source, sel, config, dtype) if target.model_export else None
        sel = export.selection if export else sel
        _notes(source, progress, export.notes if export else ())
        started = time.perf_counter()
        dest = dest_of()
        mesh_t = parse_mesh(mesh) if mesh is not None else None
        result = _write(source, sel, dest, target, "convert", budget=budget, workers=workers, progress=progress,
                        block_bytes=_block_bytes(budget), max_shard_size=shard_cap, export=export,
                        world_size=world_size or math.prod(mesh_t or (1,)), mesh=mesh_t, compression=compression,
                        source_id=pin())
        dest.remove_stale(result.files)
        _log_written("convert", src, result, started)
        return result
    finally:
        source.close()


def _formats_taking(option: str) -> str:
    """The names of the formats whose output takes ``option`` (an option's error says where it applies)."""
    return ", ".join(name for name, handler in FORMATS.items() if option in handler.write_options)


def _log_written(tool: str, src: str, result: ConvertResult, started: float) -> None:
    log.info("%s %s -> %s (%s): %s, %d bytes, %s in %.2f s", tool, src, result.dst, result.dst_format,
             human_count(result.tensors, "tensor"), result.bytes, human_count(len(result.files), "file"),
             time.perf_counter() - started)


def _write(source: Any, sel: Selection, dest: Destination, target: FormatHandler, tool: str, *,
           export: HfExport | None = None, scaleout: Scaleout = Scaleout(), **options: Any) -> ConvertResult | None:
    """Write ``sel`` from ``source`` at ``dest`` through ``target``'s handler: the one way any format is written
    (``options``: the :class:`~shardkit.checkpoint.formats.write_job.WriteJob` fields of the command).

    A format that does not resume (HF, DCP, torch.save) is written in order and
    its files are removed on a failure; native output resumes and parallelises
    (see docs/cli.md).  ``None`` in a scale-out process that left the commit to process 0.
    """
    with read_through(source, options.get("budget", DEFAULT_MAX_MEMORY), options.get("workers", 1)) as reserved:
        return _write_job(source, sel, dest, target, tool, export, scaleout, reserved, options)


def _write_job(source: Any, sel: Selection, dest: Destination, target: FormatHandler, tool: str,
               export: HfExport | None, scaleout: Scaleout, reserved: int,
               options: dict[str, Any]) -> ConvertResult | None:
    storage = dest.storage
    side_files = side_files_meanwhile(source)  # asked while the data moves, used just before the commit
    job = WriteJob(
        tensors=tuple(sel.triples), values=sel.values, aliases=sel.aliases, tool=tool,
        fetch=Fetcher(source, sel.dtype_for, sel.rename_back, reuse=True, scales=sel.scales, reserved_bytes=reserved),
        selection=tuple((t.name, t.source, str(t.dtype), tuple(t.shape)) for t in sel.tensors),
        meta=dict(source.info.meta) if source.info.format == target.name else {},
        avoid=frozenset(dest.avoid), replacing=dest.replacing, scaleout=scaleout,
        before_commit=(lambda: export.write_side_files(storage)) if export else (lambda: None),
        discard=lambda: dest.discard_created(side_files=list(export.side_files) if export else ()),
        copy_side_files=lambda into: copy_side_files(source, storage, into=into, found=side_files()), **options)
    written = target.write(storage, job)
    if written is None:
        return None
    return ConvertResult(source.info.format, target.name, storage.url, len(sel.tensors), written.nbytes,
                         written.files, sel.dropped, written.kept_bytes, written.stored_bytes)


def reshard(src: str, dst: str, *, world_size: int | None = None, mesh: tuple[int, ...] | str | None = None,
            dtype: str | None = None, dtype_optim: bool = False, compression: str | None = None,
            only: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
            rename: Sequence[str] | None = None, model_only: bool = False, overwrite: bool = False,
            storage_options: dict[str, Any] | None = None, dst_storage_options: dict[str, Any] | None = None,
            max_memory: int | str | None = None, workers: int = DEFAULT_WORKERS,
            src_format: str | None = None, progress: Progress | None = None,
            scaleout: tuple[int, int, Any] | None = None, trust_pickle: bool = False,
            model_keys: Sequence[str] | None = None) -> ConvertResult:
    """Write ``src`` as a shardkit checkpoint laid out for ``world_size`` ranks (or a 2-D ``mesh``).

    Each rank's shards land in their own data file(s), so a job of that size
    reads exactly its files.  Optimizer state is resharded with the weights;
    ``dtype`` casts model weights only, unless ``dtype_optim``; ``src_format``
    skips detection.  A rerun after an interruption skips data files already
    written (from the same SRC) and unchanged since (size, change stamp and header as journaled).
    ``scaleout=(rank, nprocs, barrier)`` splits the work across processes
    (see :mod:`shardkit.checkpoint.offline.scaleout`); process 0 commits.
    ``trust_pickle`` and ``model_keys`` are :func:`convert`'s.

    Example::

        reshard("s3://bucket/ckpt", "s3://bucket/ckpt-ws8", world_size=8,
                storage_options={"anon": False})
    """
    mesh_t = parse_mesh(mesh) if mesh is not None else None
    if world_size is None and mesh_t is None:
        raise ConfigurationError("reshard needs --world-size N or --mesh AxB")
    if mesh_t is not None and world_size is not None and world_size != math.prod(mesh_t):
        raise ConfigurationError(f"--world-size {world_size} disagrees with --mesh {mesh} ({math.prod(mesh_t)} ranks)")
    ws = world_size if world_size is not None else math.prod(mesh_t)
    if ws < 1:
        raise ConfigurationError(f"--world-size must be at least 1, got {ws}")
    budget = parse_memory(max_memory)
    rank, nprocs, agree = scaleout if scaleout else (0, 1, None)
    source, dst_storage_options, dest_of = _open_distinct(
        src, dst, storage_options, dst_storage_options, src_format,
        TorchLoadOptions(trust_pickle, _keys(model_keys), not model_only),
        (lambda options: prepare_dst_meanwhile(dst, NATIVE, options, overwrite)) if agree is None else None)
    try:
        pin = source_id_meanwhile(src, storage_options, source)
        sel = select(source.tensors(), source.values(), only=only, exclude=exclude, rename=rename,
                     model_only=model_only, dtype=dtype, dtype_optim=dtype_optim, aliases=source.aliases())
        NATIVE.check_tensors(sel.triples)
        _notes(source, progress)
        started = time.perf_counter()
        if agree is None:
            dest = dest_of()
        else:  # every process checks DST (the same answer: nothing is changed yet); process 0 alone cleans up
            try:
                dest = prepare_dst(dst, NATIVE, dst_storage_options, overwrite)
            except BaseException:
                agree(False)
                raise
            if not agree(True):
                raise CheckpointError(f"{dst}: a process could not prepare DST; see its error")
        result = _write(source, sel, dest, NATIVE, "reshard", world_size=ws, mesh=mesh_t, compression=compression,
                        source_id=pin(), budget=budget,
                        workers=workers, progress=progress, scaleout=Scaleout(rank, nprocs, agree))
        if result is not None:
            dest.remove_stale(result.files)
            _log_written("reshard", src, result, started)
        return result
    finally:
        source.close()


def _keys(model_keys: Sequence[str] | None) -> tuple[str, ...] | None:
    if isinstance(model_keys, str):
        raise ConfigurationError("model_keys is a list of parameter names; read a file with "
                                 "shardkit.checkpoint.formats.torchsave.state.read_model_keys")
    return tuple(model_keys) if model_keys is not None else None


def _native_chunks(source: Any) -> list[Any]:
    """The chunk records of a native checkpoint's manifest (none for any other format)."""
    if getattr(source.info, "format", "") != NATIVE.name:
        return []
    return [rec for t in source.manifest.tensors.values() for rec in t.chunks]


def _referenced_bytes(source: Any) -> dict[str, int]:
    """Stored bytes per sibling checkpoint a native checkpoint references (empty for any other)."""
    out: dict[str, int] = {}
    for rec in _native_chunks(source):
        if (parts := split_reference(rec.file)) is not None:
            out[parts[0]] = out.get(parts[0], 0) + rec.nbytes
    return dict(sorted(out.items()))


_PART_NAMES = {"model": "model", "module": "model", "optim": "optim", "optimizer": "optim"}


def _part_of(name: str) -> str | None:
    """Whether tensor ``name`` is model or optimizer state: the first path part that names one decides, so
    shardkit's ``model.*``/``optim.*``, DCP's ``optimizer.*`` and a ``Stateful`` nesting both
    (``app.model.*``, ``app.optim.state.*``: torch's DCP recipe) are counted alike."""
    return next((_PART_NAMES[part] for part in name.split(".") if part in _PART_NAMES), None)


def inspect(src: str, *, storage_options: Mapping[str, Any] | None = None,
            trust_pickle: bool = False) -> dict[str, Any]:
    """Describe a checkpoint: format, layout, metadata, tensors (dtype/shape/bytes/chunks), totals.

    Returns a JSON-ready dict (the CLI's ``--json`` prints it as is).  A tied key
    stored once under another (an alias) is listed with ``alias_of`` and no
    chunks of its own, and its bytes are not counted again in the totals.
    Sizes are tensor data (``bytes``: what the tensors take in memory); a native
    checkpoint's ``totals.stored_bytes`` is what its chunks take in the files
    (smaller with zstd), the figure ``verify`` reads and checks.
    Where the writer recorded how it held its tensors (native checkpoints
    saved by a job), ``layout["layouts"]`` lists each mesh and placements with
    its number of tensors, and each tensor carries its ``mesh`` and ``placements``.
    A native checkpoint saved with dedup lists under ``references`` the sibling
    checkpoints whose data files it reads, with the bytes it reads from each;
    files of theirs that are gone (a step deleted or moved by hand) are listed
    per sibling under ``missing_references``: such a checkpoint cannot be
    loaded, and the CLI's ``inspect`` exits 1 saying so.  ``trust_pickle`` is
    :func:`convert`'s, for a torch.save file whose classes need it.
    """
    source = open_reader(src, storage_options, trust_pickle=trust_pickle)
    try:
        tensors = []
        aliases = source.aliases()
        info = source.info
        held = {fqn: (e["mesh"], e["placements"]) for e in info.layouts for fqn in e["tensors"]}
        for name, e in sorted(source.tensors().items()):
            tensors.append({"name": name, "dtype": str(e.dtype).replace("torch.", ""), "shape": list(e.shape),
                            "bytes": e.nbytes, "chunks": 0 if name in aliases else len(e.chunks)}
                           | ({"alias_of": aliases[name]} if name in aliases else {})
                           | ({"mesh": held[name][0], "placements": held[name][1]} if name in held else {}))
        stored = [t for t in tensors if "alias_of" not in t]
        layouts = [{"mesh": e["mesh"], "placements": e["placements"], "tensors": len(e["tensors"])}
                   for e in info.layouts]
        layout = {k: v for k, v in (("world_size", info.world_size), ("mesh", info.mesh), ("layouts", layouts)) if v}
        shared = _referenced_bytes(source)
        chunks = _native_chunks(source)
        gone = missing_references(source.storage, {rec.file for rec in chunks}) if shared else {}
        return {"url": src, "format": info.format, "version": info.version, "layout": layout,
                "meta": dict(info.meta), "values": sorted(source.values()),
                **({"unread_values": dict(unread)} if (unread := source.unreadable_values()) else {}),
                "tensors": tensors,
                "totals": {"tensors": len(tensors), "aliases": len(tensors) - len(stored),
                           "bytes": sum(t["bytes"] for t in stored), "chunks": sum(t["chunks"] for t in stored),
                           "model_bytes": sum(t["bytes"] for t in stored if _part_of(t["name"]) == "model"),
                           "optim_bytes": sum(t["bytes"] for t in stored if _part_of(t["name"]) == "optim")}
                          | ({"stored_bytes": sum(rec.nbytes for rec in chunks)} if chunks else {}),
                **({"references": shared} if shared else {}),
                **({"missing_references": gone} if gone else {})}
    finally:
        source.close()
