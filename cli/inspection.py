"""``shardkit inspect``, ``verify`` and ``diff``: the commands that read checkpoints and change nothing.

Each calls the library function of the same name as :mod:`shardkit.checkpoint.offline.convert` exports it
and renders the answer: a description, a damage report, a per-tensor comparison.  Their verdicts are exit
codes (:class:`~shardkit.cli.exit_codes.ExitCode`): 1 when inspect finds referenced data gone, verify finds
damage, or diff finds a difference.  The commands that write are in :mod:`shardkit.cli.conversion`.
"""

from __future__ import annotations

from typing import Any

import click

from shardkit.checkpoint.offline.options import DEFAULT_MAX_MEMORY_TEXT, DEFAULT_WORKERS
from shardkit.cli.exit_codes import ExitCode
from shardkit.cli.options import storage_flags, trust_pickle_option
from shardkit.cli.passthrough import WORKERS
from shardkit.cli.render import (
    echo_json,
    human_bytes,
    human_count,
    progress_unless_quiet,
    storage_options,
    table,
)

__all__ = ["inspect", "verify", "diff"]


@click.command()
@click.argument("src")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON on stdout.")
@click.option("--limit", default=0, type=int, help="Show at most this many tensors in the table (0: all).")
@trust_pickle_option
@storage_flags("src")
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
@click.option("--workers", default=DEFAULT_WORKERS, show_default=True, type=WORKERS,
              help="Parallel reads.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@storage_flags("src")
@click.pass_context
def verify(ctx: click.Context, src: str, workers: int, as_json: bool, storage_opts: tuple[str, ...]) -> int:
    """Check every checksum and the coverage of every tensor; exit 1 naming any damage.

    \b
    Example:
      shardkit verify ./ckpt/step-100
      shardkit verify s3://bucket/ckpt --workers 16
    """
    from shardkit.checkpoint.offline.convert import verify as do_verify

    report = do_verify(src, storage_options=storage_options(storage_opts), workers=workers,
                       progress=progress_unless_quiet(ctx))
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
@storage_flags("a_b")
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
                     only=only, exclude=exclude, progress=progress_unless_quiet(ctx))
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
