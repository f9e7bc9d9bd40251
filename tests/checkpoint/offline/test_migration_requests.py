"""Migration between buckets at copy speed: ``reshard`` S3 -> S3 (moto on loopback) reads its source in
ranged GETs of 8 MiB and writes its data files in 8 MiB parts, with the source's block cache within its
memory budget; a rerun after an interrupt checks the files already written by their journal and
headers alone, and writes again a file changed or truncated after its record was journaled."""

from __future__ import annotations

import re

import pytest
import s3fs
from fsspec.asyn import sync_wrapper

import shardkit.checkpoint.formats.native.resumable as native_resumable
from shardkit.checkpoint import diff, reshard, verify
from shardkit.checkpoint.io.read_cache import BLOCK_BYTES
from shardkit.checkpoint.io.remote import RemoteFiles
from shardkit.checkpoint.io.uploads import PART_BYTES
from tests.support.offline_helpers import model_and_moments, write_torch_state

MIB = 1 << 20


class _Interrupted(Exception):
    pass


class Wire:
    """Every S3 request this process makes through s3fs, with the bytes each one carries."""

    def __init__(self, monkeypatch) -> None:
        self.requests: list[tuple[str, str, int, int | None]] = []  # (method, key, bytes, range start)
        real = s3fs.S3FileSystem._call_s3

        async def counted(fs, method, *args, **kwargs):
            out = await real(fs, method, *args, **kwargs)
            key = kwargs.get("Key", kwargs.get("Prefix", ""))
            if method == "get_object":
                if "Range" in kwargs:
                    a, b = map(int, re.match(r"bytes=(\d+)-(\d+)", kwargs["Range"]).groups())
                    self.requests.append((method, key, min(b + 1, a + int(out["ContentLength"])) - a, a))
                else:
                    self.requests.append((method, key, int(out["ContentLength"]), None))
            elif method in ("upload_part", "put_object"):
                self.requests.append((method, key, len(kwargs.get("Body") or b""), kwargs.get("PartNumber")))
            else:
                self.requests.append((method, key, 0, None))
            return out
        monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
        monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", sync_wrapper(counted))  # bound to the old one

    def of(self, method: str, under: str) -> list[tuple[str, str, int, int | None]]:
        return [r for r in self.requests if r[0] == method and f"/{under}/" in f"/{r[1]}"]


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    """A ~32 MB model + optimizer-like state (uneven rows, a scalar) as a torch.save file."""
    flat = model_and_moments(layers=4, rows=1001)
    return write_torch_state(tmp_path_factory.mktemp("state") / "src.pt", flat, [])


@pytest.fixture
def source(state, s3_url):
    """``(src URL, dst prefix, options, s3fs client)``: ``state`` saved in S3 as a 2-rank native checkpoint."""
    bucket, options = s3_url
    src = f"{bucket}/src"
    reshard(str(state), src, world_size=2, dst_storage_options=options)
    return src, f"{bucket}/dst", options, s3fs.S3FileSystem(**options)


def test_a_reshard_between_buckets_moves_its_data_in_requests_of_8_mib(source, monkeypatch):
    src, dst, options, fs = source
    sizes = {p.rsplit("/", 1)[-1]: s for p, s in fs.du(f"{src}/data", total=False).items()}
    caches = []
    read_through = RemoteFiles.read_through
    monkeypatch.setattr(RemoteFiles, "read_through",
                        lambda self, *a: caches.append(read_through(self, *a)) or caches[-1])
    wire = Wire(monkeypatch)
    reshard(src, dst, world_size=3, workers=4, storage_options=options)

    gets = wire.of("get_object", "src/data")
    for _, key, n, start in gets:  # 8 MiB blocks; only a file's last block is shorter
        assert start is not None and start % BLOCK_BYTES == 0
        assert n == BLOCK_BYTES or start + n == sizes[key.rsplit("/", 1)[-1]], (key, start, n)
    assert len(gets) == sum(-(-s // BLOCK_BYTES) for s in sizes.values())  # every block fetched once
    parts = wire.of("upload_part", "dst/data")
    assert parts and not wire.of("put_object", "dst/data")  # every data file (~10.7 MB) is a multipart upload
    by_file: dict[str, list[int]] = {}
    for _, key, n, number in parts:
        by_file.setdefault(key, []).append((number, n))
    for key, numbered in by_file.items():
        lengths = [n for _, n in sorted(numbered)]
        assert all(n == PART_BYTES for n in lengths[:-1]) and 0 < lengths[-1] <= PART_BYTES, (key, lengths)
        assert sum(lengths) == fs.size(f"{dst}/data/{key.rsplit('/', 1)[-1]}")
    assert len(caches) == 1 and 0 < caches[0].peak <= caches[0].budget + 4 * BLOCK_BYTES
    assert verify(dst, storage_options=options).ok and diff(src, dst, storage_options=options,
                                                            b_storage_options=options).equal


def test_a_reshard_asks_no_more_of_the_stores_than_its_data_needs(source, monkeypatch):
    """Beyond the data, the HEADs: one per source data file (not one per reader thread), none of the
    resume journal's records (one listing says which exist), one per output file (its change stamp)."""
    src, dst, options, fs = source
    wire = Wire(monkeypatch)
    reshard(src, dst, world_size=3, workers=4, storage_options=options)
    outputs = [p.rsplit("/", 1)[-1] for p in fs.find(f"{dst}/data")]
    heads = [key for method, key, _, _ in wire.requests if method == "head_object"]
    assert len(outputs) == 3
    assert sorted(k for k in heads if "/src/data/" in f"/{k}") == sorted(p.split("/", 1)[1]
                                                                         for p in fs.find(f"{src}/data"))
    assert not [k for k in heads if ".shardkit-resume/" in k]
    assert sorted(k.rsplit("/", 1)[-1] for k in heads if "/dst/data/" in f"/{k}") == sorted(outputs)


def test_a_rerun_reads_only_headers_back_and_rewrites_what_changed_after_its_journal(source, monkeypatch):
    src, dst, options, fs = source
    with monkeypatch.context() as m:
        m.setattr(native_resumable, "commit_resumable", lambda *a, **k: (_ for _ in ()).throw(_Interrupted()))
        with pytest.raises(_Interrupted):
            reshard(src, dst, world_size=3, workers=4, storage_options=options)
    files = sorted(fs.find(f"{dst}/data"))
    assert len(files) == 3 and not fs.exists(f"{dst}/manifest.json")
    kept, damaged, truncated = files
    data = bytearray(fs.cat_file(damaged))
    data[-5] ^= 0xFF  # same size, same header: one byte of its last chunk
    fs.pipe_file(damaged, bytes(data))
    fs.pipe_file(truncated, fs.cat_file(truncated)[:-4096])

    wire = Wire(monkeypatch)
    result = reshard(src, dst, world_size=3, workers=4, storage_options=options)
    assert result.skipped_bytes == sum(rec.nbytes for rec in _records(fs, dst, kept))
    for _, key, n, start in wire.of("get_object", "dst/data"):  # the header of each journaled file, no data
        assert start == 0 and n < 64 << 10, (key, n)
    written = {key for _, key, _, _ in wire.of("upload_part", "dst/data") + wire.of("put_object", "dst/data")}
    assert written == {damaged.split("/", 1)[1], truncated.split("/", 1)[1]}
    assert verify(dst, storage_options=options).ok
    assert diff(src, dst, storage_options=options, b_storage_options=options).equal


def _records(fs, dst: str, data_file: str):
    from shardkit.checkpoint.formats.native.manifest_parse import parse_manifest

    manifest = parse_manifest(fs.cat_file(f"{dst}/manifest.json"), "manifest")
    name = data_file.split(f"{dst.split('://')[-1]}/", 1)[-1]
    return [rec for t in manifest.tensors.values() for rec in t.chunks if rec.file == name]


def test_a_single_output_file_keeps_as_many_parts_moving_as_workers_within_the_part_budget():
    from shardkit.checkpoint.formats.native.resumable import upload_depth

    assert upload_depth(threads=4, units=1, workers=4) == 4  # convert --to shardkit: one file, four parts moving
    assert upload_depth(threads=4, units=3, workers=4) == 1  # reshard to 3 ranks: three files, one part each
    assert upload_depth(threads=1, units=1, workers=1) == 1


def test_the_source_id_is_asked_through_the_open_source_and_is_the_one_a_new_storage_gives(source, monkeypatch):
    from shardkit.checkpoint.formats import open_reader
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.checkpoint.offline.source import source_id

    src, _, options, _ = source
    reader = open_reader(src, options)
    asked = []
    read_bytes = Storage.read_bytes
    monkeypatch.setattr(Storage, "read_bytes", lambda self, *a, **k: asked.append(self) or read_bytes(self, *a, **k))
    try:
        assert source_id(src, options, reader.info.format, reader) == source_id(src, options, reader.info.format)
        assert asked[0] is reader.storage and asked[1] is not reader.storage
        other = {**options, "default_block_size": 5 << 20}
        source_id(src, other, reader.info.format, reader)
        assert asked[2] is not reader.storage  # other options: not the open source's storage
    finally:
        reader.close()


def test_the_dst_check_beside_the_opening_of_src_reports_after_src_and_changes_nothing(source):
    from shardkit.errors import CheckpointExists, CheckpointNotFound

    src, dst, options, fs = source
    reshard(src, dst, world_size=3, workers=4, storage_options=options)
    committed = fs.cat_file(f"{dst}/manifest.json")
    with pytest.raises(CheckpointNotFound):  # SRC's error first, though DST would be refused too
        reshard(f"{src}-missing", dst, world_size=2, storage_options=options)
    with pytest.raises(CheckpointExists, match="already holds a checkpoint"):
        reshard(src, dst, world_size=2, storage_options=options)
    assert fs.cat_file(f"{dst}/manifest.json") == committed and not fs.exists(f"{dst}/.shardkit-resume")


def test_the_side_files_asked_for_while_the_data_moves_reach_dst_before_its_commit(source, monkeypatch):
    import shardkit.checkpoint.offline.side_files as side_files

    src, dst, options, fs = source
    fs.pipe_file(f"{src}/extra/config.json", b'{"hidden_size": 8}')
    asked = []
    side_files_of = side_files.side_files_of
    monkeypatch.setattr(side_files, "side_files_of", lambda source: asked.append(1) or side_files_of(source))
    reshard(src, dst, world_size=3, workers=4, storage_options=options)
    assert fs.cat_file(f"{dst}/extra/config.json") == b'{"hidden_size": 8}' and asked == [1]
    assert verify(dst, storage_options=options).ok


def test_a_reshard_between_buckets_makes_one_s3_client_however_many_requests_start_at_once(source, monkeypatch):
    """SRC's and DST's opening checks, the block cache's read-ahead and the uploads all start together;
    s3fs would make a client for each request begun before the first one had its connection (a client
    with no connection yet counts as closed), and DST's check on its own thread a filesystem of its own."""
    import aiobotocore.session

    src, dst, options, fs = source
    shared = {k: v for k, v in options.items() if k != "skip_instance_cache"}  # one filesystem per thread, as the CLI
    made = []
    create_client = aiobotocore.session.AioSession.create_client
    monkeypatch.setattr(aiobotocore.session.AioSession, "create_client",
                        lambda self, *a, **k: made.append(a[:1]) or create_client(self, *a, **k))
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        reshard(src, dst, world_size=3, workers=4, storage_options=shared)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert made == [("s3",)]
    assert verify(dst, storage_options=options).ok


def test_the_cleanup_after_the_commit_sends_its_requests_together(state, monkeypatch):
    """Removing the resume journal and listing data/ and index/ for files no checkpoint uses are three
    requests on an object store, all after the commit: they are in flight at once, not one after another
    (each would wait for three at once, and fail the barrier, if they ran in a row)."""
    import threading
    import uuid

    from shardkit.checkpoint.io.storage import Storage

    dst = f"memory://cleanup-{uuid.uuid4().hex[:8]}"
    together = threading.Barrier(3, timeout=10)
    seen = []
    delete_tree, listdir = Storage.delete_tree, Storage.listdir

    def meet(what: str, storage: Storage) -> None:
        if storage.url == dst and what not in seen and storage.exists("manifest.json"):  # the cleanup's
            seen.append(what)
            together.wait()

    monkeypatch.setattr(Storage, "delete_tree", lambda self, p: meet(p, self) or delete_tree(self, p))
    monkeypatch.setattr(Storage, "listdir", lambda self, p="": meet(p, self) or listdir(self, p))
    reshard(str(state), dst, world_size=2, workers=2)
    assert sorted(seen) == [".shardkit-resume", "data", "index"]
    assert verify(dst).ok and not Storage(dst).exists(".shardkit-resume")


def test_the_source_id_of_a_source_in_a_bucket_is_asked_on_a_thread_beside_the_selection(source, monkeypatch):
    import threading

    from shardkit.checkpoint.formats import open_reader
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.checkpoint.offline.source import source_id, source_id_meanwhile

    src, _, options, _ = source
    reader = open_reader(src, options)
    asked_on = []
    read_bytes = Storage.read_bytes
    monkeypatch.setattr(Storage, "read_bytes",
                        lambda self, *a, **k: asked_on.append(threading.current_thread().name)
                        or read_bytes(self, *a, **k))
    try:
        pinned = source_id_meanwhile(src, options, reader)()
        assert asked_on[0].startswith("shardkit-source-id")
        assert pinned == source_id(src, options, reader.info.format, reader)
    finally:
        reader.close()
