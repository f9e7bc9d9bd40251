"""What each storage answers to the policy questions callers ask instead of "is it local?"."""

from __future__ import annotations

from shardkit.checkpoint.io.storage import Storage

POLICY = ("fsync_worthwhile", "reads_in_place", "rereads_from_cache", "parallel_requests_help",
          "small_reads_cheap", "maps_files", "paths_are_os_paths")


def test_a_local_disk_fsyncs_reads_in_place_maps_files_and_reads_with_one_thread(tmp_path):
    storage = Storage(str(tmp_path / "ckpt"))
    assert {q: getattr(storage, q) for q in POLICY} == {
        "fsync_worthwhile": True, "reads_in_place": True, "rereads_from_cache": True,
        "parallel_requests_help": False, "small_reads_cheap": True, "maps_files": True,
        "paths_are_os_paths": True}


def test_a_memory_storage_is_asked_like_a_remote_one():
    storage = Storage("memory://policy/ckpt")
    assert {q: getattr(storage, q) for q in POLICY} == {
        "fsync_worthwhile": False, "reads_in_place": False, "rereads_from_cache": False,
        "parallel_requests_help": True, "small_reads_cheap": False, "maps_files": False,
        "paths_are_os_paths": False}


def test_a_child_storage_answers_like_its_parent(tmp_path):
    local, memory = Storage(str(tmp_path)), Storage("memory://policy")
    assert [getattr(local.child("step-1"), q) for q in POLICY] == [getattr(local, q) for q in POLICY]
    assert [getattr(memory.child("step-1"), q) for q in POLICY] == [getattr(memory, q) for q in POLICY]


def test_write_then_replace_leaves_only_the_new_file_on_both_backends(tmp_path):
    for storage in (Storage(str(tmp_path)), Storage("memory://policy-replace")):
        storage.put_atomic("model.bin", b"old")
        storage.write_then_replace("model.bin", lambda f: f.write(b"new"))
        assert storage.read_bytes("model.bin") == b"new"
        assert [name for name, _, _ in storage.listing()] == ["model.bin"]
