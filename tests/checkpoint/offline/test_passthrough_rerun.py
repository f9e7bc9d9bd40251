"""The rerun of an interrupted byte passthrough between buckets (moto) reads no source byte that feeds only
the outputs already finished: the head start, told of DST's resume journal as the command tells it, guesses
no block, and the source's block cache fetches the bytes of the chunks still to write (rounded out to their
checksum blocks) in runs of 8 MiB or more where they run that long, each once, every byte read checked as
before -- while a first run keeps the head start's blocks; either way the output is the engine's, byte for
byte."""

from __future__ import annotations

from typing import Any

import pytest
import s3fs
import torch

import shardkit.checkpoint.formats.native.resumable as native_resumable
from shardkit.checkpoint import diff, reshard, verify
from shardkit.checkpoint.formats.native import parse_manifest
from shardkit.checkpoint.geometry.boxes import shard_range
from shardkit.checkpoint.io import head_start
from shardkit.checkpoint.io.read_cache import BLOCK_BYTES, BlockCache, merge_ranges
from shardkit.checkpoint.io.remote import RemoteFiles
from shardkit.checkpoint.offline.options import DEFAULT_MAX_MEMORY, DEFAULT_WORKERS, cache_budget
from shardkit.checkpoint.offline.passthrough import passthrough
from shardkit.errors import CorruptCheckpoint
from tests.checkpoint.offline.test_migration_requests import Wire
from tests.support.offline_helpers import write_torch_state

BUDGET = cache_budget(DEFAULT_MAX_MEMORY)


class _Interrupted(Exception):
    pass


def _flat() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)  # 1/3 of each tensor is over 1 MiB: what a head start fetches
    return {"model.w": torch.randn(3001, 256, generator=gen), "model.b": torch.randn(7, generator=gen),
            "optim.state.model.w.exp_avg": torch.randn(3001, 256, generator=gen),
            "optim.state.model.w.step": torch.tensor(5.0)}


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    return write_torch_state(tmp_path_factory.mktemp("state") / "src.pt", _flat(), [])


@pytest.fixture(scope="module")
def large_state(tmp_path_factory):
    """Two 24 MiB tensors: the rows of output ranks 1 and 2 of each run 16 MiB in a one-rank source."""
    gen = torch.Generator().manual_seed(1)
    flat = {"model.w": torch.randn(6000, 1024, generator=gen), "model.b": torch.randn(7, generator=gen),
            "optim.state.model.w.exp_avg": torch.randn(6000, 1024, generator=gen)}
    return write_torch_state(tmp_path_factory.mktemp("large") / "src.pt", flat, [])


def _source(state, s3_url, ranks: int):
    bucket, options = s3_url
    reshard(str(state), f"{bucket}/src", world_size=ranks, dst_storage_options=options)
    return f"{bucket}/src", f"{bucket}/dst", options, s3fs.S3FileSystem(**options)


def _begin(src: str, dst: str, options: dict) -> None:
    """What ``shardkit reshard SRC DST`` does before the passthrough runs: its head start."""
    assert head_start.begin(src, options, budget=BUDGET, threads=4, journal=f"{dst}/.shardkit-resume",
                            journal_options=options)


def _interrupt_after_rank_0(src: str, dst: str, options: dict, monkeypatch, max_memory: str | None = None) -> None:
    """A reshard to 3 ranks stopped once the output of rank 0 is written and journaled (one writer: the
    files in rank order; the next one raises before its record is journaled)."""
    entry = native_resumable.journal_entry

    def journal_rank_0_only(wf, *a, **k):
        if "-0-0." not in wf.name:
            raise _Interrupted(wf.name)
        return entry(wf, *a, **k)
    with monkeypatch.context() as m:
        m.setattr(native_resumable, "journal_entry", journal_rank_0_only)
        with pytest.raises(_Interrupted):
            passthrough(src, dst, tool="reshard", world_size=3, storage_options=options, workers=1,
                        max_memory=max_memory)


def _feeds(fs, src: str, ranks: int) -> dict[str, list[tuple[int, int, int, int]]]:
    """Per source data file: (start, end, output rank) of the rows each output rank reads, and the same
    rounded out to the checksum blocks of their chunk (what is read to check them): (start, end, rank,
    checked start, checked end)."""
    manifest = parse_manifest(fs.cat_file(f"{src}/manifest.json"), "manifest")
    out: dict[str, list] = {}
    for t in manifest.tensors.values():
        for rec in t.chunks:
            rows, first = (rec.shape[0], rec.offsets[0]) if rec.shape else (1, 0)
            row = rec.nbytes // max(1, rows)
            for s in range(ranks):
                lo, hi = shard_range(t.shape[0], ranks, s) if t.shape else ((0, 1) if s == 0 else (0, 0))
                a, b = (max(lo, first) - first) * row, (min(hi, first + rows) - first) * row
                if a < b:
                    checked = (a // rec.block * rec.block, min(rec.nbytes, -(-b // rec.block) * rec.block))
                    out.setdefault(rec.file, []).append((rec.start + a, rec.start + b, s, rec.start + checked[0],
                                                         rec.start + checked[1]))
    return out


def _rerun_after_rank_0(src: str, dst: str, options: dict, monkeypatch, max_memory: str | None = None,
                        between: Any = None) -> tuple[Any, Wire]:
    """Interrupt a reshard to 3 ranks once output rank 0 is finished (its record alone in DST's journal),
    then (after ``between()``) rerun it, each run with the head start the command line starts: (the rerun's
    result, its requests)."""
    try:
        _begin(src, dst, options)
        _interrupt_after_rank_0(src, dst, options, monkeypatch, max_memory)
    finally:
        head_start.drop()
    fs = s3fs.S3FileSystem(**options)
    assert [p.rsplit("-", 2)[-2] for p in fs.ls(f"{dst}/.shardkit-resume")] == ["0"]
    if between is not None:
        between()
    wire = Wire(monkeypatch)
    try:
        _begin(src, dst, options)
        return passthrough(src, dst, tool="reshard", world_size=3, storage_options=options,
                           max_memory=max_memory), wire
    finally:
        head_start.drop()


def test_a_rerun_reads_nothing_of_a_source_file_that_only_feeds_a_finished_output(state, s3_url, monkeypatch):
    src, dst, options, fs = _source(state, s3_url, 3)  # source file s holds the rows of output rank s
    result, wire = _rerun_after_rank_0(src, dst, options, monkeypatch)
    read = {key.rsplit("/", 1)[-1] for _, key, _, _ in wire.of("get_object", "src/data")}
    assert {name.rsplit("-", 2)[-2] for name in read} == {"1", "2"}  # data/<token>-<rank>-<part>.safetensors
    assert 0 < result.skipped_bytes < result.bytes
    engine = reshard(src, f"{dst}-engine", world_size=3, storage_options=options)
    assert sorted(result.files) == sorted(engine.files)
    for name in result.files:  # the engine's checkpoint, byte for byte
        assert fs.cat_file(f"{dst}/{name}") == fs.cat_file(f"{dst}-engine/{name}"), name
    assert verify(dst, storage_options=options).ok


def test_a_rerun_reads_only_the_checksum_blocks_of_the_outputs_still_to_write(state, s3_url, monkeypatch):
    src, dst, options, fs = _source(state, s3_url, 1)  # one source file: every 8 MiB block feeds every rank
    feeds = _feeds(fs, src, 3)
    result, wire = _rerun_after_rank_0(src, dst, options, monkeypatch)
    gets = wire.of("get_object", "src/data")
    first_row = {name: min(start for start, *_ in spans) for name, spans in feeds.items()}
    for _, key, n, start in gets:
        name = key.split("src/", 1)[1]
        if start + n <= first_row[name]:
            continue  # the file's header, checked before its first byte is used
        # every byte read lies in a checksum block that holds a byte of output rank 1 or 2
        wanted = [(a, b) for _, _, s, a, b in feeds[name] if s != 0]
        lo, hi = start, start + n
        assert any(a <= lo and hi <= b for a, b in merge_ranges(wanted)), (name, lo, hi)
    rank0 = sum(b - a for spans in feeds.values() for a, b, s, _, _ in spans if s == 0)
    assert result.skipped_bytes == rank0
    assert sum(n for *_, n, _ in gets) < sum(b - a for spans in feeds.values() for a, b, *_ in spans) - rank0 // 2
    assert diff(src, dst, storage_options=options, b_storage_options=options).equal
    assert verify(dst, storage_options=options).ok


def _needed_runs(feeds: dict[str, list[tuple[int, int, int, int, int]]]) -> dict[str, list[tuple[int, int]]]:
    """Per source data file, the runs of bytes that outputs 1 and 2 read (their rows, rounded out to checksum
    blocks), neighbours joined."""
    return {name: merge_ranges([(a, b) for _, _, s, a, b in spans if s != 0]) for name, spans in feeds.items()}


def _data_gets(wire: Wire, feeds: dict) -> list[tuple[str, int, int]]:
    """(file, start, end) of the rerun's GETs of source data (a file's header, read to check it before its
    first byte is used, left out)."""
    first_row = {name: min(start for start, *_ in spans) for name, spans in feeds.items()}
    gets = [(key.split("src/", 1)[1], start, start + n) for _, key, n, start in wire.of("get_object", "src/data")]
    return [(name, a, b) for name, a, b in gets if b > first_row[name]]


def _capture_caches(monkeypatch) -> list[BlockCache]:
    caches: list[BlockCache] = []
    read_through = RemoteFiles.read_through
    monkeypatch.setattr(RemoteFiles, "read_through",
                        lambda self, *a: caches.append(read_through(self, *a)) or caches[-1])
    return caches


def test_a_rerun_fetches_the_needed_bytes_once_in_requests_of_8_mib_where_they_run_that_long(
        large_state, s3_url, monkeypatch):
    src, dst, options, fs = _source(large_state, s3_url, 1)  # one source file: every aligned block feeds rank 0
    feeds = _feeds(fs, src, 3)
    runs = _needed_runs(feeds)
    result, wire = _rerun_after_rank_0(src, dst, options, monkeypatch)
    gets = _data_gets(wire, feeds)
    for name, a, b in gets:  # inside a needed run, and a block long unless the run is shorter
        run = next((lo, hi) for lo, hi in runs[name] if lo <= a and b <= hi)
        assert b - a >= min(BLOCK_BYTES, run[1] - run[0]), (name, a, b, run)
    assert max(b - a for _, a, b in gets) >= BLOCK_BYTES
    # the bytes asked of storage are the bytes needed: each once, none of output rank 0's alone
    assert sorted((name, a) for name, a, _ in gets) == sorted(set((name, a) for name, a, _ in gets))
    assert sum(b - a for _, a, b in gets) == sum(hi - lo for spans in runs.values() for lo, hi in spans)
    assert result.skipped_bytes == sum(b - a for spans in feeds.values() for a, b, s, _, _ in spans if s == 0)
    engine = reshard(src, f"{dst}-engine", world_size=3, storage_options=options)
    assert sorted(result.files) == sorted(engine.files)
    for name in result.files:  # the engine's checkpoint, byte for byte
        assert fs.cat_file(f"{dst}/{name}") == fs.cat_file(f"{dst}-engine/{name}"), name


def test_a_rerun_under_a_small_memory_budget_keeps_its_cache_within_it(large_state, s3_url, monkeypatch):
    src, dst, options, fs = _source(large_state, s3_url, 1)
    feeds = _feeds(fs, src, 3)
    runs = _needed_runs(feeds)
    caches = _capture_caches(monkeypatch)
    result, wire = _rerun_after_rank_0(src, dst, options, monkeypatch, max_memory="32MiB")
    cache = caches[-1]
    assert cache.budget == cache_budget(32 << 20)
    assert cache.peak <= cache.budget + DEFAULT_WORKERS * 2 * cache.block  # a piece is under two blocks
    for name, a, b in _data_gets(wire, feeds):
        run = next((lo, hi) for lo, hi in runs[name] if lo <= a and b <= hi)
        assert b - a >= min(cache.block, run[1] - run[0]), (name, a, b, run)
    assert 0 < result.skipped_bytes < result.bytes
    assert diff(src, dst, storage_options=options, b_storage_options=options).equal
    assert verify(dst, storage_options=options).ok


def test_a_damaged_source_byte_that_a_rerun_needs_is_refused(state, s3_url, monkeypatch):
    src, dst, options, fs = _source(state, s3_url, 1)
    feeds = _feeds(fs, src, 3)
    name, (a, b, *_) = next((name, span) for name, spans in feeds.items() for span in spans if span[2] == 2)

    def damage() -> None:  # one byte of output rank 2's rows, the file's size and header unchanged
        data = bytearray(fs.cat_file(f"{src}/{name}"))
        data[(a + b) // 2] ^= 0x40
        fs.pipe_file(f"{src}/{name}", bytes(data))
    with pytest.raises(CorruptCheckpoint, match="checksum block"):
        _rerun_after_rank_0(src, dst, options, monkeypatch, between=damage)
    assert not fs.exists(f"{dst}/manifest.json")


def test_a_first_run_keeps_the_head_starts_blocks_and_writes_the_engines_checkpoint(state, s3_url, monkeypatch):
    src, dst, options, fs = _source(state, s3_url, 1)
    taken, guessed = [], []
    take, fetch_first = head_start.take, BlockCache.fetch_first
    monkeypatch.setattr(head_start, "take", lambda fs: taken.append(take(fs)) or taken[-1])
    monkeypatch.setattr(BlockCache, "fetch_first", lambda self, blocks: guessed.append(fetch_first(self, blocks))
                        or guessed[-1])
    wire = Wire(monkeypatch)
    try:
        _begin(src, dst, options)
        result = passthrough(src, dst, tool="reshard", world_size=3, storage_options=options)
    finally:
        head_start.drop()
    assert guessed and guessed[0] > 0 and len(taken) == 1 and taken[0] is not None  # its blocks, taken over
    sizes = fs.du(f"{src}/data", total=False)
    assert len(wire.of("get_object", "src/data")) == sum(-(-n // BLOCK_BYTES) for n in sizes.values())
    engine = reshard(src, f"{dst}-engine", world_size=3, storage_options=options)
    assert sorted(result.files) == sorted(engine.files)
    for name in result.files:
        assert fs.cat_file(f"{dst}/{name}") == fs.cat_file(f"{dst}-engine/{name}"), name


def test_the_head_start_guesses_only_when_dsts_journal_holds_no_record(state, s3_url):
    src, dst, options, fs = _source(state, s3_url, 1)
    try:  # no journal, or one that cannot be listed (no such bucket): a first run, blocks guessed
        for journal in (f"{dst}/.shardkit-resume", "s3://no-such-bucket-here/x/.shardkit-resume"):
            assert head_start.begin(src, options, budget=BUDGET, threads=4, journal=journal, journal_options=options)
            assert head_start.guessed()
        fs.pipe_file(f"{dst}/.shardkit-resume/x-0-0.safetensors.json", b"{}")
        _begin(src, dst, options)
        assert not head_start.guessed()  # a rerun: nothing fetched before the writer knows what it needs
    finally:
        head_start.drop()


def test_the_command_line_names_dsts_journal_and_its_storage_options_for_the_head_start():
    from shardkit.cli.passthrough import resume_journal

    line = ["reshard", "s3://a/src", "s3://b/out/", "--world-size", "3", "--storage-option", "anon:=true",
            "--retries", "2"]
    assert resume_journal(line) == ("s3://b/out/.shardkit-resume", ["anon:=true", "shardkit.retries:=2"])
    assert resume_journal([*line, "--dst-storage-option", "key=x"])[1] == ["key=x", "shardkit.retries:=2"]
    assert resume_journal(["inspect", "s3://a/src"]) is None
