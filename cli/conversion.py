"""``shardkit reshard`` and ``shardkit convert``: the commands that write a checkpoint, and the options they share.

Both read SRC in any format and write DST (``reshard`` as a shardkit checkpoint laid out for N ranks,
``convert`` in the format ``--to`` names), through :mod:`shardkit.checkpoint.offline.scaleout`, which splits
the work across processes under torchrun.  So they take the same output, filter and source options
(``--overwrite``, ``--max-memory``, ``--only``, ``--model-keys``, ...) and report what they wrote alike; the
read-only commands are in :mod:`shardkit.cli.inspection`.  ``main.py``'s head start reads the same options
before this module is loaded (``VALUE_OPTIONS``/``FLAG_OPTIONS`` of ``passthrough.py`` list them), and so
does the byte passthrough that runs a native SRC's reshard before this module is loaded (``passthrough.py``).
"""

from __future__ import annotations

import click

from shardkit.checkpoint.formats import FORMATS, WRITABLE
from shardkit.checkpoint.offline.options import (
    DEFAULT_MAX_MEMORY_TEXT,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_WORKERS,
)
from shardkit.cli.exit_codes import ExitCode
from shardkit.cli.options import storage_flags, trust_pickle_option
from shardkit.cli.passthrough import WORKERS, WORLD_SIZES
from shardkit.cli.render import progress_unless_quiet, report_written, storage_options

__all__ = ["reshard", "convert"]


def _io_options(fn):
    opts = [
        click.option("--dst-storage-option", "dst_opts", multiple=True, metavar="KEY=VALUE",
                     help="fsspec option for DST only; repeatable."),
        click.option("--overwrite", is_flag=True, help="Replace a checkpoint already at DST."),
        click.option("--max-memory", default=DEFAULT_MAX_MEMORY_TEXT, show_default=True,
                     help="Memory budget for data in flight (e.g. 512MiB, 2GB)."),
        click.option("--workers", default=DEFAULT_WORKERS, show_default=True, type=WORKERS,
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
    return storage_flags("src_dst")(fn)


def _torch_source(fn):
    opts = [
        trust_pickle_option,
        click.option("--model-keys", metavar="FILE",
                     help="torch.save SRC: parameter names in model.named_parameters() order (one per line, or a "
                          "JSON list), naming an optimizer state keyed by number."),
    ]
    for deco in reversed(opts):
        fn = deco(fn)
    return fn


def _model_keys(path: str | None) -> list[str] | None:
    if path is None:
        return None
    from shardkit.checkpoint.formats.torchsave.state import read_model_keys

    return read_model_keys(path)


@click.command()
@click.argument("src")
@click.argument("dst")
@click.option("--world-size", type=WORLD_SIZES, help="Number of ranks the output is laid out for.")
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
                         workers=workers, progress=progress_unless_quiet(ctx), distributed=distributed,
                         trust_pickle=trust_pickle, model_keys=_model_keys(model_keys))
    if result is not None:
        report_written(result, quiet=ctx.obj.quiet, as_json=as_json)
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
                         max_memory=max_memory, workers=workers, src_format=src_format,
                         progress=progress_unless_quiet(ctx), distributed=distributed, config=config,
                         trust_pickle=trust_pickle, model_keys=_model_keys(model_keys))
    if result is not None:
        report_written(result, quiet=ctx.obj.quiet, as_json=as_json)
    return ExitCode.OK
