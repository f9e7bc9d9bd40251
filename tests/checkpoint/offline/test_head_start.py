"""The head start of a migration: the source's first 8 MiB blocks fetched before the engine is loaded, then
taken over by the reshard's block cache -- every block still fetched once, every byte checked as before,
the output the same; a head start on other storage options is closed, never used."""

from __future__ import annotations

import pytest
import s3fs

from shardkit.checkpoint import diff, reshard, verify
from shardkit.checkpoint.io import head_start
from shardkit.checkpoint.io.read_cache import BLOCK_BYTES
from shardkit.checkpoint.io.remote import RemoteFiles
from shardkit.checkpoint.offline.options import DEFAULT_MAX_MEMORY, cache_budget
from tests.checkpoint.offline.test_migration_requests import Wire
from tests.support.offline_helpers import model_and_moments, write_torch_state

BUDGET = cache_budget(DEFAULT_MAX_MEMORY)


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    return write_torch_state(tmp_path_factory.mktemp("state") / "src.pt", model_and_moments(layers=4, rows=1001), [])


@pytest.fixture
def source(state, s3_url):
    bucket, options = s3_url
    reshard(str(state), f"{bucket}/src", world_size=2, dst_storage_options=options)
    yield f"{bucket}/src", f"{bucket}/dst", options, s3fs.S3FileSystem(**options)
    head_start.drop()


def _taken(monkeypatch) -> list:
    caches = []
    read_through = RemoteFiles.read_through
    monkeypatch.setattr(RemoteFiles, "read_through",
                        lambda self, *a: caches.append(read_through(self, *a)) or caches[-1])
    return caches


def test_the_reshard_takes_over_the_blocks_a_head_start_fetched_and_fetches_each_block_once(source, monkeypatch):
    src, dst, options, fs = source
    sizes = {p: s for p, s in fs.du(f"{src}/data", total=False).items()}
    wire = Wire(monkeypatch)
    caches = _taken(monkeypatch)
    handed = []
    take = head_start.take
    monkeypatch.setattr(head_start, "take", lambda fs: handed.append(take(fs)) or handed[-1])
    assert head_start.begin(src, options, budget=BUDGET, threads=4)
    reshard(src, dst, world_size=3, workers=4, storage_options=options)

    gets = wire.of("get_object", "src/data")
    assert len(gets) == sum(-(-s // BLOCK_BYTES) for s in sizes.values())  # every block once, head start included
    assert len({(key, start) for _, key, _, start in gets}) == len(gets)
    assert not wire.of("head_object", "src/data")  # the sizes came with the head start's listing
    assert len(caches) == 1 and caches[0].peak <= BUDGET + 4 * BLOCK_BYTES
    assert handed == [caches[0]]  # the head start's cache, its blocks in it
    assert verify(dst, storage_options=options).ok
    assert diff(src, dst, storage_options=options, b_storage_options=options).equal


def test_a_head_start_on_other_storage_options_is_closed_and_the_reshard_reads_on_its_own(source, monkeypatch):
    src, dst, options, fs = source
    other = {**options, "default_block_size": 5 << 20}  # the same store, but not the same options
    assert head_start.begin(src, other, budget=BUDGET, threads=4)
    caches = _taken(monkeypatch)
    reshard(src, dst, world_size=3, workers=4, storage_options=options)
    assert len(caches) == 1 and head_start.take(fs) is None
    assert diff(src, dst, storage_options=options, b_storage_options=options).equal


def test_no_head_start_for_a_local_source_or_one_it_cannot_open(tmp_path):
    assert not head_start.begin(str(tmp_path), None, budget=BUDGET, threads=4)
    assert not head_start.begin(f"file://{tmp_path}", None, budget=BUDGET, threads=4)
    assert not head_start.begin("s3://bucket/x", {"shardkit": {"retries": "many"}}, budget=BUDGET, threads=4)


def test_the_first_blocks_are_the_data_files_in_name_order_from_byte_0_within_the_budget():
    block = 8
    sizes = {"c/manifest.json": 100, "c/data/b-0-1": 20, "c/data/b-0-0": 20}
    assert head_start.first_blocks(sizes, block, budget=None) == []  # files under 1 MiB are metadata
    mib = 1 << 20
    sizes = {"c/manifest.json": 100, "c/data/b-0-1": 2 * mib + 5, "c/data/b-0-0": 2 * mib}
    assert head_start.first_blocks(sizes, mib, budget=3 * mib) == [("c/data/b-0-0", 0), ("c/data/b-0-0", 1),
                                                                    ("c/data/b-0-1", 0)]
