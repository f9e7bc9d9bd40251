"""async_save's writers: a long-lived writer process per rank (the default) and a thread of the training process.

What they must both do: copy the state before training changes it, keep host
memory flat over many saves, and never let a failure cost the checkpoint that
was there before.
"""

from __future__ import annotations

import gc
import os
import signal
import threading

import psutil
import pytest
import torch
import torch.distributed as dist

import shardkit.checkpoint as skc
from shardkit.checkpoint.training.async_save.saver import background_saver
from shardkit.errors import CheckpointError, ConfigurationError
from tests.support.dist import run_on_ranks


def _sharded_state(fill: float):
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.support.checkpoint_helpers import make_mesh

    mesh = make_mesh((dist.get_world_size(),))
    return {"w": distribute_tensor(torch.full((2048, 1024), fill), mesh, [Shard(0)])}  # 8 MiB, 4 MiB per rank


def _async_saves(url_base: str, n_saves: int, writer: str) -> dict:
    """Async saves while training and collectives go on; RSS of this process and of its writer process."""
    state = _sharded_state(0.0)
    me = psutil.Process()
    rss, writer_rss, writer_pids = [], [], set()
    for i in range(n_saves):
        state["w"].to_local().fill_(float(i))
        future = skc.async_save(state, f"{url_base}/s{i}", meta={"i": i}, writer=writer)
        state["w"].to_local().fill_(-1.0)  # training goes on: the save must hold the old values
        for _ in range(3):
            dist.all_reduce(torch.ones(16))  # the default group stays the training thread's
        future.result()
        gc.collect()
        rss.append(me.memory_info().rss)
        pid = background_saver().writer_process.pid
        if writer == "process":
            writer_pids.add(pid)
            writer_rss.append(psutil.Process(pid).memory_info().rss)
    checks = []
    for i in (0, n_saves - 1):
        target = _sharded_state(0.0)
        skc.load(target, f"{url_base}/s{i}")
        checks.append(bool((target["w"].to_local() == float(i)).all()))
    return {"rss_growth": rss[-1] - rss[1], "writer_rss_growth": writer_rss[-1] - writer_rss[1] if writer_rss else 0,
            "writer_pids": sorted(writer_pids), "checks": checks}


@pytest.mark.parametrize("writer, saves", [("thread", 8), ("process", 20)])
def test_async_save_copies_the_state_then_writes_with_flat_host_memory(tmp_path, writer, saves):
    out = run_on_ranks(2, _async_saves, str(tmp_path / "async"), saves, writer)
    for rank in out:
        assert rank["checks"] == [True, True]
        assert rank["rss_growth"] < 2 * 2**20, rank["rss_growth"]  # staging is reused, not re-allocated
        assert rank["writer_rss_growth"] < 2 * 2**20, rank["writer_rss_growth"]
    if writer == "process":  # one long-lived writer per rank, spawned once and reused for every save
        assert [len(rank["writer_pids"]) for rank in out] == [1, 1]
        assert out[0]["writer_pids"] != out[1]["writer_pids"]


def _kill_rank0_writer_mid_save(url: str) -> dict:
    first = skc.async_save(_sharded_state(1.0), url, writer="process")
    first.result()
    writer_pid = background_saver().writer_process.pid
    if dist.get_rank() == 0:
        os.kill(writer_pid, signal.SIGSTOP)  # it takes the next request and never answers
    dist.barrier()
    doomed = skc.async_save(_sharded_state(2.0), url, writer="process")
    if dist.get_rank() == 0:
        os.kill(writer_pid, signal.SIGKILL)
    try:
        doomed.result()
        error = None
    except CheckpointError as exc:
        error = str(exc)
    survivor = _sharded_state(0.0)
    skc.load(survivor, url)
    kept = bool((survivor["w"].to_local() == 1.0).all())
    skc.async_save(_sharded_state(3.0), url, writer="process").result()  # a new writer takes over
    after = _sharded_state(0.0)
    skc.load(after, url)
    return {"error": error, "kept": kept, "old_pid": writer_pid, "new_pid": background_saver().writer_process.pid,
            "next_save": bool((after["w"].to_local() == 3.0).all())}


def test_a_writer_process_killed_mid_save_fails_the_save_everywhere_and_keeps_the_previous_checkpoint(tmp_path):
    url = str(tmp_path / "ckpt")
    rank0, rank1 = run_on_ranks(2, _kill_rank0_writer_mid_save, url)
    assert rank0["error"] is not None and f"writer process (pid {rank0['old_pid']}) was killed by SIGKILL" \
        in rank0["error"] and "nothing was committed" in rank0["error"]
    assert rank1["error"] is not None and "failed on rank 0" in rank1["error"]
    assert rank0["kept"] and rank1["kept"]
    assert rank0["next_save"] and rank1["next_save"]
    assert rank0["new_pid"] != rank0["old_pid"] and rank1["new_pid"] == rank1["old_pid"]
    assert skc.verify(url).ok


def test_an_unknown_writer_or_a_process_writer_for_memory_storage_is_refused_before_anything_is_staged():
    state = {"w": torch.ones(4)}
    with pytest.raises(ConfigurationError, match="writer must be one of process, thread"):
        skc.async_save(state, "memory://writer-choice/a", writer="fork")
    with pytest.raises(ConfigurationError, match="memory:// filesystem lives in this process only"):
        skc.async_save(state, "memory://writer-choice/b", writer="process")
    skc.async_save(state, "memory://writer-choice/c").result()  # the default writes memory:// from a thread
    out = {"w": torch.zeros(4)}
    skc.load(out, "memory://writer-choice/c")
    assert torch.equal(out["w"], state["w"])


def test_storage_options_the_writer_process_cannot_receive_are_refused_naming_the_url(tmp_path):
    with pytest.raises(ConfigurationError, match="storage_options must be JSON"):
        skc.async_save({"w": torch.ones(4)}, str(tmp_path / "x"), storage_options={"opener": object()},
                       writer="process")


def _exchanges_over_saves(url: str) -> dict:
    """How often saves exchange every rank's boxes: once per structure, not once per save."""
    from shardkit.checkpoint.training import writer_assignment as save_module

    def state(fill: float) -> dict:  # a structure no other test saves, so no earlier exchange is reused
        from torch.distributed.tensor import Shard, distribute_tensor

        from tests.support.checkpoint_helpers import make_mesh

        return {"reuse-w": distribute_tensor(torch.full((66, 5), fill), make_mesh((2,)), [Shard(0)])}

    calls = []
    original = save_module.assign_writers
    save_module.assign_writers = lambda dist_, held: calls.append(1) or original(dist_, held)
    try:
        counts = []
        for i in range(3):  # the same structure three times, through both entry points
            plain = state(float(i))
            skc.save(plain, f"{url}/plain-{i}") if i % 2 else skc.async_save(plain, f"{url}/plain-{i}").result()
            counts.append(len(calls))
        grown = {**state(5.0), "extra": torch.full((3,), float(dist.get_rank()))}
        skc.save(grown, f"{url}/grown")  # a new key: the ranks exchange again
        counts.append(len(calls))
        skc.save(grown, f"{url}/grown-again")
        counts.append(len(calls))
        # one rank alone holding something new must still make every rank exchange (or they would hang)
        lone = {**grown, "rank0-only": torch.ones(2)} if dist.get_rank() == 0 else grown
        skc.save(lone, f"{url}/lone")
        counts.append(len(calls))
    finally:
        save_module.assign_writers = original
    loaded = state(0.0)
    skc.load(loaded, f"{url}/plain-2")
    return {"counts": counts, "values_ok": bool((loaded["reuse-w"].to_local() == 2.0).all())}


def test_saves_of_an_unchanged_structure_reuse_the_writer_assignment_after_one_small_agreement(tmp_path):
    for rank in run_on_ranks(2, _exchanges_over_saves, str(tmp_path)):
        # async_save (its own group), save (the default group), async_save again (reused), then the
        # grown state twice (exchanged once), then rank 0 alone changing (exchanged by both)
        assert rank["counts"] == [1, 2, 2, 3, 3, 4], rank["counts"]
        assert rank["values_ok"]


def _async_repeats(url: str) -> dict:
    """Async saves of one structure; then one rank alone moves its shard to new memory."""
    from torch.distributed.tensor import DTensor, Shard

    from shardkit.checkpoint.training.async_save import repeat_copy
    from tests.support.checkpoint_helpers import make_mesh

    mesh, rank = make_mesh((2,)), dist.get_rank()
    state = {"repeat-w": DTensor.from_local(torch.zeros(32, 6), mesh, [Shard(0)]), "step": 0}
    plans, original = [], repeat_copy.plan_save
    repeat_copy.plan_save = lambda *a, **k: plans.append(1) or original(*a, **k)
    counts = []
    try:
        for i in range(3):
            state["repeat-w"].to_local().fill_(float(i))
            state["step"] = i
            skc.async_save(state, f"{url}/s{i}").result()
            counts.append(len(plans))
        if rank == 1:  # same shapes and placements, new memory on this rank only
            state["repeat-w"] = DTensor.from_local(torch.full((32, 6), 7.0), mesh, [Shard(0)])
        skc.async_save(state, f"{url}/moved").result()
        counts.append(len(plans))
        state["repeat-w"].to_local().fill_(8.0)
        skc.async_save(state, f"{url}/after").result()
        counts.append(len(plans))
    finally:
        repeat_copy.plan_save = original
    loaded = {}
    for name in ("s0", "s1", "s2", "moved", "after"):
        out = {"repeat-w": DTensor.from_local(torch.empty(32, 6), mesh, [Shard(0)]), "step": -1}
        skc.load(out, f"{url}/{name}")
        loaded[name] = (out["repeat-w"].full_tensor()[::32, 0].tolist(), out["step"])
    return {"counts": counts, "loaded": loaded}


def test_async_saves_of_an_unchanged_structure_only_copy_and_one_rank_changing_makes_all_plan_again(tmp_path):
    for rank in run_on_ranks(2, _async_repeats, str(tmp_path)):
        # planned once for the first save, again when rank 1 alone moved its shard, then reused
        assert rank["counts"] == [1, 1, 1, 2, 2], rank["counts"]
        assert rank["loaded"] == {"s0": ([0.0, 0.0], 0), "s1": ([1.0, 1.0], 1), "s2": ([2.0, 2.0], 2),
                                  "moved": ([2.0, 7.0], 2), "after": ([8.0, 8.0], 2)}, rank["loaded"]


def test_a_manager_refuses_a_writer_without_background_saves(tmp_path):
    with pytest.raises(ConfigurationError, match="pass async_save=True with it"):
        skc.CheckpointManager(str(tmp_path / "run"), writer="thread")


@pytest.mark.parametrize("background", [False, True], ids=["save", "async_save"])
def test_repeated_saves_follow_every_change_of_the_state_between_them(tmp_path, background):
    """Planning is reused between saves of an unchanged state; every kind of change is still seen."""
    def save(state: dict, name: str) -> dict:
        url = str(tmp_path / name)
        skc.async_save(state, url).result() if background else skc.save(state, url)
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        skc.load(out, url, strict=False)
        return out

    def aliases(name: str) -> dict:
        return {t["name"]: t["alias_of"] for t in skc.inspect(str(tmp_path / name))["tensors"] if "alias_of" in t}

    shared = torch.arange(12.0).reshape(3, 4)
    tied = {"a": shared, "b": shared, "c": torch.ones(5)}
    assert save(tied, "tied")["b"].equal(shared) and aliases("tied") == {"b": "a"}
    untied = {"a": shared, "b": shared.clone() * 2, "c": torch.ones(5)}  # same keys and shapes, new memory
    assert save(untied, "untied")["b"].equal(shared * 2) and aliases("untied") == {}
    shared.mul_(10)  # in place: same memory, new values
    assert save(untied, "in-place")["a"].equal(shared)
    resized = {"a": shared, "b": torch.ones(2, 2), "c": torch.ones(5)}
    assert save(resized, "resized")["b"].equal(torch.ones(2, 2))
    fewer = {"a": shared}
    assert set(save(fewer, "fewer")) == {"a"}


def test_switching_writers_back_and_forth_never_writes_a_stale_staging_buffer(tmp_path):
    # the thread writer frees the shared buffer; the next one may get the same file descriptor and size
    state = {"w": torch.zeros(256, 256)}
    for i, writer in enumerate(["process", "thread", "process", "thread", "process"]):
        state["w"].fill_(float(i))
        skc.async_save(state, str(tmp_path / f"s{i}"), writer=writer).result()
        out = {"w": torch.empty(256, 256)}
        skc.load(out, str(tmp_path / f"s{i}"))
        assert bool((out["w"] == float(i)).all()), (i, writer)


def _async_commits_in_the_writer(url: str) -> dict:
    """Async saves whose training process never builds a manifest or decodes a report; a sync save does."""
    import shardkit.checkpoint.training.save as save_module
    from shardkit.checkpoint.formats.native import WrittenFile

    commits_here = []
    commit, decode = save_module.commit_gathered, save_module.report_from_json
    file_from_json = WrittenFile.__dict__["from_json"]
    save_module.commit_gathered = lambda *a, **k: commits_here.append("commit") or commit(*a, **k)
    save_module.report_from_json = lambda doc: commits_here.append("decode") or decode(doc)
    WrittenFile.from_json = classmethod(lambda cls, doc: commits_here.append("file")
                                        or file_from_json.__func__(cls, doc))
    try:
        for i in range(3):
            skc.async_save(_sharded_state(float(i)), f"{url}/async-{i}", meta={"i": i}, writer="process").result()
        async_commits = list(commits_here)
        skc.save(_sharded_state(7.0), f"{url}/sync")
    finally:
        save_module.commit_gathered, save_module.report_from_json = commit, decode
        WrittenFile.from_json = file_from_json
    loaded = []
    for i in range(3):
        target = _sharded_state(-1.0)
        skc.load(target, f"{url}/async-{i}")
        loaded.append(bool((target["w"].to_local() == float(i)).all()))
    return {"async_commits": async_commits, "sync_commits": commits_here[len(async_commits):], "loaded": loaded,
            "meta": skc.inspect(f"{url}/async-2")["meta"]}


def test_rank_0s_async_commit_is_made_by_its_writer_process_from_reports_the_training_process_never_decodes(tmp_path):
    url = str(tmp_path / "ckpt")
    rank0, rank1 = run_on_ranks(2, _async_commits_in_the_writer, url)
    assert rank0["async_commits"] == [] and rank1["async_commits"] == []
    # ... nor a file record of its writer process: those go on as they came (a sync save decodes both reports)
    assert rank0["sync_commits"] == ["decode", "file", "decode", "file", "commit"] and rank1["sync_commits"] == []
    assert rank0["loaded"] == rank1["loaded"] == [True, True, True]
    assert rank0["meta"] == {"i": 2}
    for name in ("async-0", "async-1", "async-2", "sync"):
        assert skc.verify(f"{url}/{name}").ok


def _kill_rank0_writer_as_it_commits(url: str) -> dict:
    from shardkit.checkpoint.training.async_save.writer_commit import CommitRequest

    skc.async_save(_sharded_state(1.0), url, writer="process").result()
    writer_pid = background_saver().writer_process.pid
    encode = CommitRequest.encode

    def stopped_then_killed(self, *args, **kwargs):  # the writer wrote every file; it takes the commit, then dies
        os.kill(writer_pid, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (writer_pid, signal.SIGKILL)).start()
        return encode(self, *args, **kwargs)

    CommitRequest.encode = stopped_then_killed
    try:
        skc.async_save(_sharded_state(2.0), url, writer="process").result()
        error = None
    except CheckpointError as exc:
        error = str(exc)
    finally:
        CommitRequest.encode = encode
    survivor = _sharded_state(0.0)
    skc.load(survivor, url)
    data_files = sorted(os.listdir(os.path.join(url, "data")))
    skc.async_save(_sharded_state(3.0), url, writer="process").result()  # a new writer takes over
    after = _sharded_state(0.0)
    skc.load(after, url)
    return {"error": error, "kept": bool((survivor["w"].to_local() == 1.0).all()), "data_files": data_files,
            "next_save": bool((after["w"].to_local() == 3.0).all()), "old_pid": writer_pid}


def test_a_writer_process_killed_as_it_commits_fails_the_save_everywhere_and_removes_only_the_new_files(tmp_path):
    url = str(tmp_path / "ckpt")
    rank0, rank1 = run_on_ranks(2, _kill_rank0_writer_as_it_commits, url)
    assert f"writer process (pid {rank0['old_pid']}) was killed by SIGKILL while committing" in rank0["error"]
    assert "nothing was committed" in rank0["error"] and "nothing was committed" in rank1["error"]
    assert rank0["kept"] and rank1["kept"]  # the previous checkpoint, whole
    assert len(rank0["data_files"]) == 2  # every rank's new files removed, the committed ones kept
    assert rank0["next_save"] and rank1["next_save"]
    assert skc.verify(url).ok


def test_a_commit_whose_writer_died_reads_as_committed_only_where_the_manifest_lists_every_file_of_the_save(tmp_path):
    from shardkit.checkpoint.formats.native import read_manifest
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.checkpoint.training.async_save.writer_commit import outcome_from_storage

    url = str(tmp_path / "ckpt")
    skc.save({"w": torch.arange(6.0)}, url)
    storage = Storage(url)
    files = set(read_manifest(storage).files)
    assert outcome_from_storage(storage, files, "the writer died") is None
    refused = outcome_from_storage(storage, files | {"data/someone-else.safetensors"}, "the writer died")
    assert refused is not None and "does not list this save's files: nothing was committed" in refused["message"]
    assert outcome_from_storage(storage, set(), "the writer died") is not None  # nothing to recognise it by
    assert outcome_from_storage(Storage(str(tmp_path / "empty")), files, "the writer died") is not None


def test_a_file_record_the_writer_process_sent_is_passed_on_as_it_came_and_decodes_to_the_written_file():
    from shardkit.checkpoint.formats.native import WrittenFile
    from shardkit.checkpoint.formats.native.manifest import ChunkRecord
    from shardkit.checkpoint.training.save import RelayedFile

    record = ChunkRecord((0,), (4,), "data/a.safetensors", "w@0", 64, 16, "raw", 8, (1, 2))
    written = WrittenFile("data/a.safetensors", 80, 1, (("w", record),))
    relayed = RelayedFile.of(written.to_json())
    assert (relayed.name, relayed.size, relayed.fqns) == ("data/a.safetensors", 80, ("w",))
    assert relayed.to_json() == written.to_json()
    assert relayed.decoded() == written


def _damaged_record_from_the_writer(url: str) -> dict:
    """The writer process's record of a file says one crc32c fewer than its chunk has blocks."""
    from shardkit.checkpoint.training.async_save.writer_process import WriterProcess

    skc.async_save(_sharded_state(1.0), url, writer="process").result()
    write_files = WriterProcess.write_files

    def one_crc_short(self, *args, **kwargs):
        import base64

        from shardkit.checkpoint.training.save import RelayedFile

        files = write_files(self, *args, **kwargs)
        if dist.get_rank() != 1:
            return files
        doc = dict(files[0].doc)
        chunk = dict(doc["chunks"][0][1])
        chunk["crc32c"] = base64.b64encode(base64.b64decode(chunk["crc32c"])[:-4]).decode("ascii")
        doc["chunks"] = [[doc["chunks"][0][0], chunk]] + doc["chunks"][1:]
        return [RelayedFile.of(doc)] + files[1:]

    WriterProcess.write_files = one_crc_short
    try:
        skc.async_save(_sharded_state(2.0), url, writer="process", block_bytes=1 << 20).result()
        error = None
    except CheckpointError as exc:
        error = type(exc).__name__ + ": " + str(exc)
    finally:
        WriterProcess.write_files = write_files
    kept = _sharded_state(0.0)
    skc.load(kept, url)
    return {"error": error, "kept": bool((kept["w"].to_local() == 1.0).all())}


def test_a_damaged_record_from_a_writer_process_fails_the_commit_on_every_rank_and_keeps_the_checkpoint(tmp_path):
    url = str(tmp_path / "ckpt")
    rank0, rank1 = run_on_ranks(2, _damaged_record_from_the_writer, url)
    assert rank0["error"] is not None and rank0["error"] == rank1["error"]
    # rank 1's 4 MiB in 1 MiB blocks: rank 0's commit decodes its record and refuses it, naming the file
    assert rank0["error"].startswith("InvalidManifest: data/") and "-1-0.safetensors" in rank0["error"]
    assert rank0["error"].endswith("records 3 block checksums, expected 4")
    assert rank0["kept"] and rank1["kept"]
    assert skc.verify(url).ok
