"""--storage-option: KEY=VALUE is a string, KEY:=JSON is typed, dotted keys nest."""

from __future__ import annotations

import click
import pytest

from shardkit.cli.render import storage_options


def test_plain_values_stay_strings_and_typed_values_are_json():
    got = storage_options(["secret=12345", "key=007", "anon:=false", "default_block_size:=8388608",
                           "client_kwargs.endpoint_url=http://127.0.0.1:9000", "client_kwargs.verify:=true"])
    assert got == {"secret": "12345", "key": "007", "anon": False, "default_block_size": 8388608,
                   "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "verify": True}}


@pytest.mark.parametrize("bad", ["novalue", "anon:=yes"])
def test_malformed_pairs_name_the_option(bad):
    with pytest.raises(click.BadParameter, match="KEY=VALUE|JSON"):
        storage_options([bad])
