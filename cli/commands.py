"""The ``shardkit`` subcommands: reshard, convert, inspect, verify, diff.

Each one parses its options, calls the library function of the same name
(``reshard`` and ``convert`` through :mod:`shardkit.checkpoint.offline.scaleout`,
which splits them across processes under torchrun; ``inspect``, ``verify`` and
``diff`` as :mod:`shardkit.checkpoint.offline.convert` exports them), and renders
the result.  Exit code 0 means
success; 1 means the command found a problem (verify: damage, diff: a
difference) or failed with a one-line error.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

import click

from shardkit.checkpoint.formats import FORMATS, WRITABLE
from shardkit.checkpoint.offline.options import (
    DEFAULT_MAX_MEMORY_TEXT,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_WORKERS,
)
from shardkit.cli.exit_codes import ExitCode
from shardkit.cli.render import echo_json, human_bytes, human_count, storage_options, table

if TYPE_CHECKING:
    from shardkit.checkpoint.offline.progress import Progress

# what --storage-option applies to, per command: only the locations that command has
STORAGE_OPTION_HELP = {
    "src": "fsspec option for SRC; repeatable.",
    "src_dst": "fsspec option for SRC (and DST unless --dst-storage-option); repeatable.",
    "a_b": "fsspec option for A (and B unless --b-storage-option); repeatable.",
}

COMMON_STORAGE = [
    click.option("--retries", type=click.IntRange(0, 100), metavar="N",
                 help="Retries of a failed storage request [default: 3; 0 on gs:// and az://, whose SDKs retry]. "
                      "Same as --storage-option shardkit.retries:=N, for every URL."),
    click.option("--timeout", type=click.FloatRange(0, min_open=True), metavar="SECONDS",
                 help="Seconds a storage request may wait for an answer [default: 8]. Same as "
                      "--storage-option shardkit.timeout:=SECONDS, for every URL."),
]


def _storage(locations: str):
    """``--storage-option``, ``--retries`` and ``--timeout``; ``locations`` (a key of
    :data:`STORAGE_OPTION_HELP`) says which of the command's URLs ``--storage-option`` reaches."""
    def decorate(fn):
        return _with_storage(fn, STORAGE_OPTION_HELP[locations])
    return decorate


def _with_storage(fn, storage_option_help: str):
    @functools.wraps(fn)
    def with_retries_and_timeout(*args: Any, retries: int | None, timeout: float | None, **kwargs: Any) -> Any:
        # --retries/--timeout are shorthands: append them to every URL's storage options (an empty
        # --dst-storage-option / --b-storage-option list means "as SRC" and inherits them from there)
        extra = tuple(f"shardkit.{k}:={v}" for k, v in (("retries", retries), ("timeout", timeout)) if v is not None)
        for name in ("storage_opts", "dst_opts", "b_opts"):
            if name in kwargs and (name == "storage_opts" or kwargs[name]):
                kwargs[name] = tuple(kwargs[name]) + extra
        return fn(*args, **kwargs)

    for deco in reversed(COMMON_STORAGE):
        with_retries_and_timeout = deco(with_retries_and_timeout)
    return click.option("--storage-option", "storage_opts", multiple=True, metavar="KEY=VALUE",
                        help=storage_option_help)(with_retries_and_timeout)


def _io_options(fn):
    opts = [
        click.option("--dst-storage-option", "dst_opts", multiple=True, metavar="KEY=VALUE",
                     help="fsspec option for DST only; repeatable."),
        click.option("--overwrite", is_flag=True, help="Replace a checkpoint already at DST."),
        click.option("--max-memory", default=DEFAULT_MAX_MEMORY_TEXT, show_default=True,
                     help="Memory budget for data in flight (e.g. 512MiB, 2GB)."),
        click.option("--workers", default=DEFAULT_WORKERS, show_default=True, type=click.IntRange(1, 256),
                     help="Parallel ranged reads / uploads (shardkit output)."),
        click.option("--only", multiple=True, metavar="GLOB", help="Keep only keys matching GLOB; repeatable."),
        click.option("--exclude", multiple=True, metavar="GLOB", help="Drop keys matching GLOB; repeatable."),
        click.option("--rename", multiple=True, metavar="REGEX=REPL", help="Rename keys (re.sub); repeatable."),
        click.option("--model-only", is_flag=True, help="Keep model weights only (drop optimizer state)."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout."),
        click.option("--distributed/--single-process", default=None,
                     help="Split the work over the processes of a torchrun launch (default: on under torchrun "
                          "only; WORLD_SIZE alone does not turn it on)."),
    ]
    for deco in reversed(opts):
        fn = deco(fn)
    return _storage("src_dst")(fn)


_trust_pickle_option = click.option(
    "--trust-pickle", is_flag=True,
    help="torch.save SRC: unpickle classes outside torch.load's weights_only allowlist. UNSAFE: runs any code the "
         "file names; only for files you trust.")


def _torch_source(fn):
    opts = [
        _trust_pickle_option,
        click.option("--model-keys", metavar="FILE",
                     help="torch.save SRC: parameter names in model.named_parameters() order (one per line, or a "
                          "JSON list), naming an optimizer state keyed by number."),
    ]
    for deco in reversed(opts):
        fn = deco(fn)
    return fn


def formats_help() -> str:
    """The help's list of formats, one line each, from the format registry (so a new format shows up)."""
    width = max(len(name) for name in FORMATS)
    lines = [f"  {name.ljust(width)}  {fmt.description}" for name, fmt in FORMATS.items()]
    return "\b\nFormats (detected; --from and --to name them):\n" + "\n".join(lines)


def _model_keys(path: str | None) -> list[str] | None:
    if path is None:
        return None
    from shardkit.checkpoint.formats.torchsave.state import read_model_keys

    return read_model_keys(path)


def _progress(ctx: click.Context) -> "Progress | None":
    if ctx.obj.quiet:
        return None
    from shardkit.checkpoint.offline.progress import Progress

    progress = Progress(stream=sys.stderr)
    ctx.call_on_close(progress.close)  # runs before main() prints a failure's "error: ..." line
    return progress


def _report_written(ctx: click.Context, result: Any, as_json: bool) -> None:
    if as_json:
        echo_json(result.__dict__)
        return
    if not ctx.obj.quiet:
        click.echo(f"wrote {result.dst_format} checkpoint {result.dst}: {human_count(result.tensors, 'tensor')}, "
                   f"{human_bytes(result.bytes)} of tensor data, {human_bytes(result.stored_bytes)} stored"
                   + (f" ({human_bytes(result.skipped_bytes)} of tensor data already there, kept)"
                      if result.skipped_bytes else ""), err=True)
        if result.dropped:
            click.echo(f"left out {human_count(len(result.dropped), 'key')} (filters/format), e.g. {result.dropped[0]}",
                       err=True)


@click.command()
@click.argument("src")
@click.argument("dst")
@click.option("--world-size", type=click.IntRange(1, 1 << 20), help="Number of ranks the output is laid out for.")
@click.option("--mesh", help="2-D layout RxS (replicas x shards), e.g. 2x4; replicated data is written once.")
@click.option("--dtype", help="Cast model weights to bf16/fp16/fp32 on the way.")
@click.option("--dtype-optim", is_flag=True, help="With --dtype, cast floating optimizer state too.")
@click.option("--compression", metavar="zstd[:LEVEL]", help="Compress each chunk with zstd (default level 1).")
@_io_options
@_torch_source
@click.pass_context
def reshard(ctx: click.Context, src: str, dst: str, world_size: int | None, mesh: str | None, dtype: str | None,
            dtype_optim: bool, compression: str | None, storage_opts: tuple[str, ...], dst_opts: tuple[str, ...],
            overwrite: bool, max_memory: str, workers: int, only: tuple[str, ...], exclude: tuple[str, ...],
            rename: tuple[str, ...], model_only: bool, as_json: bool, distributed: bool | None, trust_pickle: bool,
            model_keys: str | None) -> int:
    """Write SRC as a shardkit checkpoint laid out for N ranks, each rank's shards in its own file(s).

    SRC may be any format shardkit reads; optimizer state is resharded with the
    weights.  Streams chunk by chunk in bounded memory; rerunning after an
    interruption resumes (data files already written and verified are kept).
    Under torchrun the work is split across the ranks.

    \b
    Example:
      shardkit reshard ./ckpt/step-100 ./ckpt/step-100-ws8 --world-size 8
      shardkit reshard s3://a/ckpt s3://b/ckpt --mesh 2x4 --compression zstd:3 \\
          --storage-option client_kwargs.endpoint_url=http://127.0.0.1:9000
    """
    from shardkit.checkpoint.offline.scaleout import run_reshard

    ctx.obj.resumable = True  # native output: a rerun resumes from the journal at DST
    so = storage_options(storage_opts)
    result = run_reshard(src, dst, world_size=world_size, mesh=mesh, dtype=dtype, dtype_optim=dtype_optim,
                         compression=compression, only=only, exclude=exclude, rename=rename, model_only=model_only,
                         overwrite=overwrite, storage_options=so,
                         dst_storage_options=storage_options(dst_opts) if dst_opts else so, max_memory=max_memory,
                         workers=workers, progress=_progress(ctx), distributed=distributed, trust_pickle=trust_pickle,
                         model_keys=_model_keys(model_keys))
    if result is not None:
        _report_written(ctx, result, as_json)
    return ExitCode.OK


@click.command()
@click.argument("src")
@click.argument("dst")
@click.option("--to", "to", required=True, type=click.Choice(list(WRITABLE)),
              help="Output format.")
@click.option("--from", "src_format", type=click.Choice(list(FORMATS)),
              help="Source format (detected when omitted).")
@click.option("--dtype", help="Cast model weights to bf16/fp16/fp32 on the way.")
@click.option("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, show_default=True,
              help="HF output: cap per shard file.")
@click.option("--compression", metavar="zstd[:LEVEL]", help="shardkit output: compress each chunk with zstd.")
@click.option("--config", "config", metavar="FILE_OR_DIR",
              help="HF output: the model's config.json, or a directory (e.g. one save_pretrained wrote) whose "
                   "config, tokenizer and generation files go beside the weights.")
@_io_options
@_torch_source
@click.pass_context
def convert(ctx: click.Context, src: str, dst: str, to: str, src_format: str | None, dtype: str | None,
            max_shard_size: str, compression: str | None, config: str | None, storage_opts: tuple[str, ...],
            dst_opts: tuple[str, ...],
            overwrite: bool, max_memory: str, workers: int, only: tuple[str, ...], exclude: tuple[str, ...],
            rename: tuple[str, ...], model_only: bool, as_json: bool, distributed: bool | None, trust_pickle: bool,
            model_keys: str | None) -> int:
    """Convert SRC (format detected) to another format at DST.

    HF output is one model.safetensors when the weights fit in one shard
    (--max-shard-size), else size-capped shards + model.safetensors.index.json,
    beside the source's side files (config.json, tokenizer files) or those of
    --config; with a config, tied weights are written as save_pretrained
    writes them (lm_head.weight left out when the config says
    "tie_word_embeddings": true) and --dtype is written into config.json.  DCP output is readable by torch's
    dcp.load; torch output is one torch.save file.  Keys use shardkit's flattened names (model.<param>,
    optim.state.<param>.<name>).

    Only shardkit output resumes after an interruption and uses --workers;
    hf, torch and dcp output is written sequentially and starts over when rerun.

    \b
    Example:
      shardkit convert ./llama-hf ./llama-sk --to shardkit
      shardkit convert ./ckpt/step-100 ./export --to hf --config ./llama-3.2-1b --dtype bf16
      shardkit convert ./dcp-ckpt model.pt --to torch --model-only --exclude '*.rotary*'
    """
    from shardkit.checkpoint.offline.scaleout import run_convert

    ctx.obj.resumable = FORMATS[to].resumes()  # only native output resumes; hf, torch and dcp output start over
    so = storage_options(storage_opts)
    result = run_convert(src, dst, to=to, only=only, exclude=exclude, rename=rename, model_only=model_only,
                         dtype=dtype, max_shard_size=max_shard_size, compression=compression, overwrite=overwrite,
                         storage_options=so, dst_storage_options=storage_options(dst_opts) if dst_opts else so,
                         max_memory=max_memory, workers=workers, src_format=src_format, progress=_progress(ctx),
                         distributed=distributed, config=config, trust_pickle=trust_pickle,
                         model_keys=_model_keys(model_keys))
    if result is not None:
        _report_written(ctx, result, as_json)
    return ExitCode.OK


@click.command()
@click.argument("src")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON on stdout.")
@click.option("--limit", default=0, type=int, help="Show at most this many tensors in the table (0: all).")
@_trust_pickle_option
@_storage("src")
@click.pass_context
def inspect(ctx: click.Context, src: str, as_json: bool, limit: int, trust_pickle: bool,
            storage_opts: tuple[str, ...]) -> int:
    """Show a checkpoint's format, layout, metadata, tensors and totals.

    \b
    Example:
      shardkit inspect ./ckpt/step-100
      shardkit inspect s3://bucket/ckpt --json | jq .totals
    """
    from shardkit.checkpoint.offline.convert import inspect as do_inspect

    info = do_inspect(src, storage_options=storage_options(storage_opts), trust_pickle=trust_pickle)
    if as_json:
        echo_json(info)
        return _refuse_missing_references(src, info)
    layout = info["layout"] or {}
    click.echo(f"{info['url']}: {info['format']} checkpoint")
    if layout:
        mesh = layout.get("mesh") or {}
        shape = "x".join(str(d) for d in mesh.get("shape", [])) or "?"
        # the mesh's dim names where the writer recorded each tensor's placements (listed below), else its placements
        named = ", ".join(mesh.get("dim_names", [])) if layout.get("layouts") else ""
        placements = named or ", ".join(mesh.get("placements", []))
        click.echo(f"layout: world size {layout.get('world_size', '?')}"
                   + (f", mesh {shape} ({placements})" if mesh else ""))
        for held in layout.get("layouts", []):
            dims = held["mesh"].get("dim_names") or []
            on = "x".join(str(d) for d in held["mesh"].get("shape", []))
            click.echo(f"  {', '.join(held['placements'])} on mesh {on}" + (f" ({', '.join(dims)})" if dims else "")
                       + f": {human_count(held['tensors'], 'tensor')}")
    if info["meta"]:
        click.echo("meta: " + ", ".join(f"{k}={v}" for k, v in sorted(info["meta"].items())))
    if info["values"]:
        click.echo("values: " + ", ".join(info["values"]))
        for key, why in sorted(info.get("unread_values", {}).items()):
            click.echo(f"  {key}: {why}; not read")
    shown = info["tensors"][:limit] if limit else info["tensors"]
    placed = any("placements" in t for t in shown)  # the writer recorded how each tensor was held
    click.echo(table(([t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", human_bytes(t["bytes"]),
                       t["chunks"]] + ([", ".join(t.get("placements", [])) or "-"] if placed else [])
                      for t in shown),
                     ["name", "dtype", "shape", "size", "chunks"] + (["placements"] if placed else []),
                     "lllrr" + ("l" if placed else "")))
    if len(shown) < len(info["tensors"]):
        click.echo(f"... {len(info['tensors']) - len(shown)} more")
    tied = [f"{t['name']} = {t['alias_of']}" for t in shown if "alias_of" in t]
    if tied:
        click.echo("tied (stored once, under the second name): " + ", ".join(tied))
    tot = info["totals"]
    click.echo(f"total: {human_count(tot['tensors'], 'tensor')}, {human_bytes(tot['bytes'])} of tensor data "
               f"(model {human_bytes(tot['model_bytes'])}, optimizer {human_bytes(tot['optim_bytes'])}) in "
               f"{human_count(tot['chunks'], 'chunk')}"
               + (f", {human_bytes(tot['stored_bytes'])} stored" if "stored_bytes" in tot else ""))
    for sibling, nbytes in info.get("references", {}).items():
        click.echo(f"references {human_bytes(nbytes)} stored by ../{sibling} (its unchanged chunks)")
    return _refuse_missing_references(src, info)


def _refuse_missing_references(src: str, info: dict[str, Any]) -> int:
    """Exit 1 naming the referenced files that are gone: the description stands (it is the manifest's),
    but a checkpoint that cannot be loaded is never reported as if it were fine."""
    missing = info.get("missing_references") or {}
    if not missing:
        return ExitCode.OK
    for sibling, names in missing.items():
        click.echo(f"missing: {human_count(len(names), 'data file')} of ../{sibling} that this checkpoint "
                   f"references, e.g. ../{sibling}/{names[0]}", err=True)
    steps = ", ".join(f"../{s}" for s in missing)
    click.echo(f"error: {src} cannot be loaded: data it references in {steps} is gone (deleted or moved by hand); "
               "restore it, or use another checkpoint", err=True)
    return ExitCode.CHECKPOINT


@click.command()
@click.argument("src")
@click.option("--workers", default=DEFAULT_WORKERS, show_default=True, type=click.IntRange(1, 256),
              help="Parallel reads.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@_storage("src")
@click.pass_context
def verify(ctx: click.Context, src: str, workers: int, as_json: bool, storage_opts: tuple[str, ...]) -> int:
    """Check every checksum and the coverage of every tensor; exit 1 naming any damage.

    \b
    Example:
      shardkit verify ./ckpt/step-100
      shardkit verify s3://bucket/ckpt --workers 16
    """
    from shardkit.checkpoint.offline.convert import verify as do_verify

    report = do_verify(src, storage_options=storage_options(storage_opts), workers=workers, progress=_progress(ctx))
    if as_json:
        echo_json(report.to_json())
    elif report.ok and report.scope == "headers":
        click.echo(f"ok: {report.format} checkpoint {src}: {human_count(report.tensors, 'tensor')}; headers and "
                   f"coverage only "
                   f"(the format records no checksums of the data)")
    elif report.ok:
        click.echo(f"ok: {report.format} checkpoint {src}: {human_count(report.tensors, 'tensor')}, "
                   f"{human_bytes(report.bytes_checked)} stored, checked in {report.seconds:.2f} s "
                   f"({human_bytes(report.rate)}/s)")
    else:
        for problem in report.problems:
            click.echo(f"damaged: {' '.join(problem.split())}", err=True)
    if not report.ok:
        if not as_json:
            click.echo(f"error: {src} is damaged: {human_count(len(report.problems), 'problem')}, listed above",
                       err=True)
        return ExitCode.CHECKPOINT
    return ExitCode.OK


@click.command()
@click.argument("a")
@click.argument("b")
@click.option("--atol", default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--rtol", default=0.0, show_default=True, help="Relative tolerance.")
@click.option("--max-memory", default=DEFAULT_MAX_MEMORY_TEXT, show_default=True,
              help="Memory budget for blocks being compared.")
@click.option("--b-storage-option", "b_opts", multiple=True, metavar="KEY=VALUE", help="fsspec option for B only.")
@click.option("--only", multiple=True, metavar="GLOB", help="Compare only keys matching GLOB; repeatable.")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Skip keys matching GLOB; repeatable.")
@click.option("--all", "show_all", is_flag=True, help="List equal tensors too.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@_storage("a_b")
@click.pass_context
def diff(ctx: click.Context, a: str, b: str, atol: float, rtol: float, max_memory: str, b_opts: tuple[str, ...],
         only: tuple[str, ...], exclude: tuple[str, ...], show_all: bool, as_json: bool,
         storage_opts: tuple[str, ...]) -> int:
    """Per-tensor max abs/rel difference of two checkpoints in any formats and layouts.

    Exit 0 only when every tensor and value is equal (bitwise), or within
    --atol/--rtol when given.

    \b
    Example:
      shardkit diff ./ckpt/step-100 ./export-hf
      shardkit diff ./a ./b --atol 1e-3 --rtol 1e-2 --only 'model.*'
    """
    from shardkit.checkpoint.offline.convert import diff as do_diff

    so = storage_options(storage_opts)
    report = do_diff(a, b, atol=atol, rtol=rtol, storage_options=so,
                     b_storage_options=storage_options(b_opts) if b_opts else so, max_memory=max_memory,
                     only=only, exclude=exclude, progress=_progress(ctx))
    if report.scope and not ctx.obj.quiet:
        click.echo(f"note: comparing {report.scope}", err=True)
    if as_json:
        echo_json(report.to_json())
    else:
        rows = [[t.name, t.status, f"{t.max_abs:.3g}", f"{t.max_rel:.3g}", t.detail] for t in report.tensors
                if show_all or t.status != "equal"]
        if rows:
            click.echo(table(rows, ["name", "status", "max_abs", "max_rel", "detail"], "llrrl"))
        for name in report.values:
            click.echo(f"value {name}: differs")
        for name, why in sorted(report.not_compared.items()):
            click.echo(f"value {name}: not compared ({why})")
        n_eq = sum(t.status == "equal" for t in report.tensors)
        verdict = "equal" if report.equal else "DIFFERENT"
        click.echo(f"{verdict}: {n_eq} of {human_count(len(report.tensors), 'tensor')} bitwise equal, "
                   f"max abs diff {max([t.max_abs for t in report.tensors], default=0.0):.3g}, "
                   f"{human_count(len(report.values), 'value differs', 'values differ')}")
    return ExitCode.OK if report.equal else ExitCode.CHECKPOINT


COMMANDS = [reshard, convert, inspect, verify, diff]
