"""The default load is one verified pass; ``verify_first=True`` is all or nothing; a manager resume falls back.

Every checksum block is checked as its bytes land in their target, so a
damaged checkpoint is found while targets are being written.  Every rank then
raises the same error (class and message), naming the file and key at fault
and the tensors that may be partly written -- or, for damage found before the
first write (a truncated or missing data file: sizes are checked up front),
saying that no target was written.  ``CheckpointManager.load_latest`` reloads
every target from the next older step, and refuses to report "nothing to
resume" over a model a failed load has written into.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import shardkit.checkpoint as skc
from shardkit.checkpoint.formats.native.manifest import ChunkRecord
from shardkit.checkpoint.formats.native.reader import NativeReader
from shardkit.errors import CheckpointError, CorruptCheckpoint, IncompatibleStateDict, ShardkitError
from tests.support.checkpoint_helpers import build_model, make_optimizer, train
from tests.support.dist import run_on_ranks
from tests.support.read_sharing import sharing_every_read

ROWS, COLS = 64, 16


def _rows(fill: float | None) -> dict[str, torch.Tensor]:
    """``w``: rows sharded over the ranks; ``b``: a plain tensor every rank loads (one rank reads it
    and sends it to the others)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) if fill is None \
        else torch.full((ROWS, COLS), fill)
    b = torch.arange(300, dtype=torch.float32) if fill is None else torch.full((300,), fill)
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": b}


def _save_rows(url: str) -> None:
    skc.save(_rows(None), url, chunk_bytes=1024, block_bytes=256)


def _record(url: str, fqn: str) -> ChunkRecord:
    """The stored chunk of ``fqn`` holding its last rows (only the last rank loads them)."""
    chunks = NativeReader(url).tensors()[fqn].chunks
    return max(chunks, key=lambda c: c.offsets[0] if c.offsets else 0).locator


def _damage(url: str, kind: str, fqn: str = "w") -> ChunkRecord:
    rec = _record(url, fqn)
    path = Path(url) / rec.file
    data = bytearray(path.read_bytes())
    if kind == "flipped":
        data[rec.start + rec.nbytes - 3] ^= 0x10  # inside the data, past the header every load checks first
        path.write_bytes(bytes(data))
    elif kind == "truncated":
        path.write_bytes(bytes(data[:-1]))
    else:
        path.unlink()
    return rec


def _load_rows(url: str, options: dict) -> tuple[str, str, tuple[str, ...], bool]:
    """(error class, message, tensors it says may be partly written, whether every target is as it was)."""
    sd = _rows(-1.0)
    try:
        with sharing_every_read():  # ``b`` is read by one rank and sent, however few its bytes
            skc.load(sd, url, **options)
    except ShardkitError as exc:
        outcome = type(exc).__name__, str(exc), getattr(exc, "partly_written", None)
    else:
        outcome = "loaded", "", ()
    untouched = bool((sd["w"].to_local() == -1.0).all()) and bool((sd["b"] == -1.0).all())
    return (*outcome, untouched)


@pytest.fixture
def rows(tmp_path) -> str:
    url = str(tmp_path / "rows")
    run_on_ranks(2, _save_rows, url)
    return url


@pytest.mark.parametrize("fqn", ["w", "b"], ids=["own-read", "shared-read"])
def test_a_flipped_byte_fails_the_default_load_on_every_rank_naming_the_file_and_the_partly_written_targets(
        rows, fqn):
    rec = _damage(rows, "flipped", fqn)
    results = run_on_ranks(2, _load_rows, rows, {})
    assert len({result[:3] for result in results}) == 1, results  # the same error on every rank
    name, message, partly_written, _ = results[0]
    assert name == "ChecksumMismatch"
    assert f"'{fqn}' chunk at {list(rec.offsets)}" in message and Path(rec.file).name in message
    assert "Targets may be partly written: 2 keys (b, w); load an older checkpoint into them, " \
           "or pass verify_first=True to keep the targets as they were when a load fails." in message
    assert partly_written == ("b", "w")


@pytest.mark.parametrize("kind", ["truncated", "missing"])
def test_a_truncated_or_missing_data_file_fails_the_default_load_on_every_rank_before_any_write(rows, kind):
    rec = _damage(rows, kind)
    results = run_on_ranks(2, _load_rows, rows, {})
    assert len({result[:3] for result in results}) == 1, results
    name, message, partly_written, _ = results[0]
    assert name == "CorruptCheckpoint"
    assert Path(rec.file).name in message and ("is missing" if kind == "missing" else "has ") in message
    assert message.endswith("No target was written.") and "partly written" not in message
    assert partly_written == ()
    assert all(untouched for *_, untouched in results)


@pytest.mark.parametrize("kind", ["flipped", "truncated", "missing"])
def test_verify_first_leaves_every_target_untouched_on_every_rank(rows, kind):
    rec = _damage(rows, kind)
    results = run_on_ranks(2, _load_rows, rows, {"verify_first": True})
    assert len({result[:3] for result in results}) == 1, results
    name, message, partly_written, _ = results[0]
    assert name == ("ChecksumMismatch" if kind == "flipped" else "CorruptCheckpoint")
    assert Path(rec.file).name in message and message.endswith("No target was written.")
    assert partly_written == ()
    assert all(untouched for *_, untouched in results)


def _load_hsdp_with_a_damaged_share(url: str) -> tuple[str, str, tuple[str, ...]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    sd = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Replicate(), Shard(0)]), "b": torch.zeros(300)}
    try:
        with sharing_every_read():  # the replicas share their reads, however few the bytes
            skc.load(sd, url)
    except ShardkitError as exc:
        return type(exc).__name__, str(exc), getattr(exc, "partly_written", None)
    return "loaded", "", ()


def test_a_flipped_byte_in_a_replica_shared_at_hsdp_2x2_fails_every_rank_without_a_hang(rows):
    rec = _damage(rows, "flipped")
    results = run_on_ranks(4, _load_hsdp_with_a_damaged_share, rows, timeout=60)
    assert len(set(results)) == 1, results
    name, message, partly_written = results[0]
    assert name == "ChecksumMismatch" and Path(rec.file).name in message
    assert partly_written == ("b", "w")


def _local_shards(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from shardkit.checkpoint.state.tree import flatten

    tensors = flatten(skc.get_training_state(model, opt)).tensors
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in tensors.items()}


def _flip_the_optimizer_state(url: str) -> None:
    """One byte of the biggest ``exp_avg`` chunk, in its data: found while the load writes its targets."""
    entries = NativeReader(url).tensors()
    key = max((k for k in entries if k.endswith(".exp_avg")), key=lambda k: entries[k].nbytes)
    rec = entries[key].chunks[0].locator
    path = Path(url) / rec.file
    data = bytearray(path.read_bytes())
    data[rec.start + 5] ^= 0x01
    path.write_bytes(bytes(data))


def _resume_over_a_damaged_newest_step(root: str) -> tuple[object, bool, str]:
    import torch.distributed as dist

    model = build_model("shardkit", seed=1)
    opt = make_optimizer(model)
    train(model, opt, range(1))
    manager = skc.CheckpointManager(root)
    manager.save(1, model, opt, extra={"saved": 1})
    older = _local_shards(model, opt)
    train(model, opt, range(1, 2))
    manager.save(2, model, opt, extra={"saved": 2})
    dist.barrier()
    if dist.get_rank() == 0:
        _flip_the_optimizer_state(manager.url_of(2))
    dist.barrier()
    fresh = build_model("shardkit", seed=7)
    fresh_opt = make_optimizer(fresh)
    train(fresh, fresh_opt, range(3, 4))
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("shardkit").addHandler(handler)
    try:
        resumed = skc.CheckpointManager(root).load_latest(fresh, fresh_opt)
    finally:
        logging.getLogger("shardkit").removeHandler(handler)
    now = _local_shards(fresh, fresh_opt)
    same = now.keys() == older.keys() and all(torch.equal(now[k], older[k]) for k in now)
    return resumed, same, "\n".join(said)


def test_load_latest_over_a_damaged_newest_step_reloads_the_model_and_optimizer_of_the_older_one(tmp_path):
    results = run_on_ranks(2, _resume_over_a_damaged_newest_step, str(tmp_path / "run"))
    for resumed, same, _ in results:
        assert resumed == (1, {"saved": 1})
        assert same  # bitwise: every local shard of the model and the optimizer state equals step 1's
    said = results[0][2]  # every rank skips the step alike: the job says so once, through rank 0
    assert "step 2 " in said and "ChecksumMismatch" in said and "Targets may be partly written" in said
    assert "trying an older step, which reloads every target" in said
    assert "step 2 " not in results[1][2]


def test_load_latest_raises_instead_of_returning_none_when_every_step_failed_after_writing_targets(tmp_path):
    manager = skc.CheckpointManager(str(tmp_path / "run"))
    model = build_model("plain", seed=1)
    opt = make_optimizer(model)
    train(model, opt, range(1), alone=True)
    for step in (1, 2):
        manager.save(step, model, opt)
        _flip_the_optimizer_state(manager.url_of(step))
    fresh = build_model("plain", seed=2)
    with pytest.raises(CorruptCheckpoint) as raised:
        manager.load_latest(fresh, make_optimizer(fresh))
    assert str(raised.value) == (
        f"cannot resume under {manager.root_url}: every committed step (1, 2) is damaged, and the failed load of "
        f"steps 2, 1 may have partly written the model and optimizer: they hold no step, so do not train from "
        f"them. Repair a step (shardkit verify names the damaged files) or rebuild the model")
    from shardkit.checkpoint.state.tree import flatten

    tensors = set(flatten(skc.get_training_state(fresh, make_optimizer(fresh))).tensors)
    assert set(raised.value.partly_written) == tensors | {"rng.rank0.torch", "rng.rank0.numpy.key"}


def test_a_load_without_a_process_group_that_failed_mid_write_says_so(tmp_path):
    model = build_model("plain", seed=1)
    opt = make_optimizer(model)
    train(model, opt, range(1), alone=True)
    url = str(tmp_path / "one")
    skc.save(skc.get_training_state(model, opt), url)
    _flip_the_optimizer_state(url)
    fresh = build_model("plain", seed=2)
    target = skc.get_training_state(fresh, make_optimizer(fresh))
    with pytest.raises(CorruptCheckpoint, match=r"exp_avg.*Targets may be partly written: \d+ keys \(") as raised:
        skc.load(target, url)
    assert "optim.state" in " ".join(raised.value.partly_written)


def test_only_a_native_checkpoint_on_a_local_disk_is_reread_from_the_page_cache(tmp_path):
    import fsspec

    url = str(tmp_path / "ck")
    skc.save({"x": torch.arange(4.0)}, url)
    fs = fsspec.filesystem("memory")
    for path in sorted(Path(url).rglob("*")):
        if path.is_file():
            fs.pipe(f"memory://reread/{path.relative_to(url).as_posix()}", path.read_bytes())
    try:
        assert NativeReader(url).rereads_from_cache is True
        assert NativeReader("memory://reread").rereads_from_cache is False
    finally:
        fs.rm("memory://reread", recursive=True)


def test_a_failed_load_leaves_cast_targets_and_values_as_they_were(tmp_path):
    url = str(tmp_path / "cast")
    skc.save({"w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS), "step": 7}, url,
             chunk_bytes=1024, block_bytes=256)
    _damage(url, "flipped")
    target = {"w": torch.full((ROWS, COLS), -1.0, dtype=torch.bfloat16), "step": 5}
    with pytest.raises(CorruptCheckpoint) as raised:
        skc.load(target, url, dtype_cast=True)
    assert raised.value.partly_written == ("w",)  # read into its host buffer, never copied into the target
    assert bool((target["w"] == -1.0).all()) and target["step"] == 5


def _save_rows_and_a_value(url: str) -> None:
    skc.save({"w": _rows(None)["w"], "step": 7}, url, chunk_bytes=1024, block_bytes=256)


def _load_rows_and_a_value(url: str) -> tuple[str, tuple[str, ...], object]:
    """Rank 0 replaces the value ``step`` while rank 1's own read of ``w`` fails (no read is shared)."""
    sd = {"w": _rows(-1.0)["w"], "step": 5}
    try:
        skc.load(sd, url)
    except ShardkitError as exc:
        return type(exc).__name__, exc.partly_written, sd["step"]
    return "loaded", (), sd["step"]


def test_a_value_replaced_on_one_rank_before_another_rank_failed_is_named_partly_written(tmp_path):
    url = str(tmp_path / "valued")
    run_on_ranks(2, _save_rows_and_a_value, url)
    _damage(url, "flipped")  # the last rows: rank 1's
    results = run_on_ranks(2, _load_rows_and_a_value, url)
    assert results == [("ChecksumMismatch", ("step", "w"), 7), ("ChecksumMismatch", ("step", "w"), 5)]


def test_a_load_without_a_process_group_that_fails_before_writing_says_no_target_was_written(tmp_path):
    url = str(tmp_path / "alone")
    skc.save({"w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)}, url, chunk_bytes=1024)
    rec = _damage(url, "missing")
    target = {"w": torch.full((ROWS, COLS), -1.0)}
    with pytest.raises(CorruptCheckpoint) as raised:
        skc.load(target, url)
    assert Path(rec.file).name in str(raised.value) and str(raised.value).endswith(". No target was written.")
    assert raised.value.partly_written == () and bool((target["w"] == -1.0).all())


def _load_rows_out_of_memory_on_rank_1(url: str) -> tuple[str, bool, bool, str, tuple[str, ...]]:
    from unittest import mock

    import torch.distributed as dist

    from shardkit.checkpoint.training import load as load_module

    real = load_module.read_requests

    def read_requests(reader, requests):
        real(reader, requests)
        if dist.get_rank() == 1:
            raise torch.OutOfMemoryError("out of memory reading 'w'")

    with mock.patch.object(load_module, "read_requests", read_requests):
        try:
            skc.load(_rows(-1.0), url)
        except ShardkitError as exc:
            return (type(exc).__name__, isinstance(exc, torch.OutOfMemoryError),
                    isinstance(exc, CheckpointError), str(exc), exc.partly_written)
    return "loaded", False, False, "", ()


def test_a_built_in_failure_keeps_its_type_in_the_error_every_rank_raises(rows):
    results = run_on_ranks(2, _load_rows_out_of_memory_on_rank_1, rows)
    assert len(set(results)) == 1, results
    name, is_out_of_memory, is_checkpoint_error, message, partly_written = results[0]
    assert (name, is_out_of_memory, is_checkpoint_error) == ("CheckpointOutOfMemoryError", True, True)
    assert message.startswith(f"loading {rows} failed on rank 1 (OutOfMemoryError: out of memory reading 'w')")
    assert partly_written == ("b", "w")


def _load_rows_counting_gathered_key_lists(url: str, strict: bool) -> tuple[tuple[str, ...], int]:
    """(what the error says may be partly written, how many key lists this rank took part in all-gathering);
    under ``strict=False`` rank 1's state dict lacks ``b``, so the ranks hold different keys."""
    from unittest import mock

    import torch.distributed as dist

    from shardkit.checkpoint.io.dist import Dist

    real, lists = Dist.all_gather_json, []

    def all_gather_json(self, obj):
        lists.extend([obj] if isinstance(obj, list) and obj and all(isinstance(k, str) for k in obj) else [])
        return real(self, obj)

    sd = _rows(-1.0)
    if not strict and dist.get_rank() == 1:
        del sd["b"]
    with mock.patch.object(Dist, "all_gather_json", all_gather_json):
        try:
            skc.load(sd, url, strict=strict)
        except ShardkitError as exc:
            return exc.partly_written, len(lists)
    return (), len(lists)


@pytest.mark.parametrize("strict", [True, False], ids=["same-keys", "different-keys"])
def test_a_failed_load_names_every_ranks_keys_without_all_gathering_key_lists(rows, strict):
    _damage(rows, "flipped")
    assert run_on_ranks(2, _load_rows_counting_gathered_key_lists, rows, strict) == [(("b", "w"), 0)] * 2


class _Net(torch.nn.Module):
    """A linear layer, and with ``extra`` a parameter ``x`` the older step does not hold."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(COLS, COLS)
        if extra:
            self.x = torch.nn.Parameter(torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS))


def _root_whose_newest_step_holds_a_damaged_key_the_older_lacks(tmp_path) -> skc.CheckpointManager:
    manager = skc.CheckpointManager(str(tmp_path / "run"))
    torch.manual_seed(0)
    manager.save(1, _Net(extra=False))
    manager.save(2, _Net(extra=True))
    _damage(manager.url_of(2), "flipped", "model.x")
    return manager


def test_load_latest_refuses_a_fallback_step_that_lacks_a_key_the_damaged_step_wrote(tmp_path):
    manager = _root_whose_newest_step_holds_a_damaged_key_the_older_lacks(tmp_path)
    with pytest.raises(CorruptCheckpoint) as raised:
        manager.load_latest(_Net(extra=True), strict=False)
    assert str(raised.value) == (
        f"cannot resume from step 1 under {manager.root_url}: the failed load of step 2 may have partly written "
        f"1 key (model.x) that step 1 does not hold (a load with strict=False leaves them alone), so the model "
        f"would hold neither step. Repair step 2 (shardkit verify names the damaged files) or rebuild the model")
    assert raised.value.partly_written == ("model.x",)


def test_load_latest_says_an_earlier_attempt_wrote_the_targets_when_the_fallback_fails_otherwise(tmp_path):
    manager = _root_whose_newest_step_holds_a_damaged_key_the_older_lacks(tmp_path)
    with pytest.raises(IncompatibleStateDict) as raised:
        manager.load_latest(_Net(extra=True))  # strict: step 1 lacks model.x
    message = str(raised.value)
    assert "missing keys ['model.x']" in message and "No target was written" in message
    touched = ("model.lin.bias", "model.lin.weight", "model.x", "rng.rank0.numpy.key", "rng.rank0.torch")
    assert message.endswith(f". Loading step 1 was a fallback: the failed load of step 2 before it may have partly "
                            f"written 5 keys ({', '.join(touched)}), which hold no step; do not train from them")
    assert raised.value.partly_written == touched
