"""S3 writes in parts: a file is sent in parts of exactly the part size (the last one shorter) in order,
at most ``depth`` in flight, one PUT for a file smaller than a part; a discarded write aborts its upload."""

from __future__ import annotations

import threading
import time

import pytest

from shardkit.checkpoint.io.uploads import PartUploads


class FakeS3:
    """The s3fs calls PartUploads makes, recorded; parts take a moment, so several can be in flight."""

    def __init__(self, fail_part: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.objects: dict[str, bytes] = {}
        self.parts: dict[int, bytes] = {}
        self.inflight = self.most = 0
        self.lock = threading.Lock()
        self.fail_part = fail_part

    def split_path(self, path: str) -> tuple[str, str, None]:
        bucket, key = path.split("/", 1)
        return bucket, key, None

    def invalidate_cache(self, path: str) -> None:
        pass

    def call_s3(self, method: str, **kw) -> dict:
        body = kw.get("Body", b"")
        with self.lock:
            self.calls.append((method, len(body)))
        if method == "create_multipart_upload":
            return {"UploadId": "u1"}
        if method == "upload_part":
            with self.lock:
                self.inflight += 1
                self.most = max(self.most, self.inflight)
            time.sleep(0.01)
            with self.lock:
                self.inflight -= 1
            if kw["PartNumber"] == self.fail_part:
                raise OSError("connection reset")
            self.parts[kw["PartNumber"]] = bytes(body)
            return {"ETag": f'"{kw["PartNumber"]}"'}
        if method == "complete_multipart_upload":
            numbers = [p["PartNumber"] for p in kw["MultipartUpload"]["Parts"]]
            assert numbers == sorted(numbers) and all("ETag" in p for p in kw["MultipartUpload"]["Parts"])
            self.objects[kw["Key"]] = b"".join(self.parts[n] for n in numbers)
        if method == "put_object":
            self.objects[kw["Key"]] = bytes(body)
        return {}


def test_a_file_goes_in_parts_of_the_part_size_at_most_depth_at_a_time():
    fs = FakeS3()
    data = bytes(range(256)) * 1000  # 256,000 bytes
    f = PartUploads(fs, "b/k", part=10_000, depth=2)
    for a in range(0, len(data), 777):  # writes of any size
        f.write(memoryview(data)[a:a + 777])
    f.close()
    assert fs.objects["k"] == data
    sizes = [n for m, n in fs.calls if m == "upload_part"]
    assert sizes == [10_000] * 25 + [6_000] and fs.most <= 2
    assert [m for m, _ in fs.calls].count("complete_multipart_upload") == 1


def test_a_file_smaller_than_a_part_is_one_put():
    fs = FakeS3()
    with PartUploads(fs, "b/k", part=10_000) as f:
        f.write(b"x" * 9_999)
    assert fs.calls == [("put_object", 9_999)] and fs.objects["k"] == b"x" * 9_999


def test_a_failed_part_fails_the_write_and_discard_aborts_the_upload():
    fs = FakeS3(fail_part=3)
    f = PartUploads(fs, "b/k", part=1_000, depth=2)
    with pytest.raises(OSError, match="connection reset"):
        for _ in range(10):
            f.write(b"y" * 1_000)
        f.close()
    f.discard()
    assert ("abort_multipart_upload", 0) in fs.calls and "k" not in fs.objects
