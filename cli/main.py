"""Entry point of the ``shardkit`` command."""

from __future__ import annotations

import click

from shardkit import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="shardkit")
def cli() -> None:
    """Inspect, verify, compare, reshard and convert checkpoints.

    \b
    Example:
      shardkit inspect ./ckpt/step-100
    """


def main() -> None:
    cli()
