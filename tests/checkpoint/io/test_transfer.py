"""Moving checkpoint directories between ranks (``shardkit.checkpoint.io.transfer``): byte-identical copies
in bounded memory, the commit file last, and the rule of trust at the target."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from shardkit.checkpoint.io import transfer_files
from shardkit.checkpoint.io.transfer import DirectoryMove, move_directories, round_schedule
from shardkit.errors import ConfigurationError
from tests.support.dist import run_on_ranks

RANKS = 4
ROUND = 4096


def _rank_dir(root: str, node: int, rank: int) -> str:
    """Where ``rank``'s copy of step 17 lives on ``node`` (one "node" per rank here)."""
    return os.path.join(root, f"node{node}", "step-00000017", f"rank-{rank}")


def _write_checkpoint(directory: str, seed: int, big: int = 3 * ROUND + 123) -> None:
    """A small checkpoint-shaped directory: a data file larger than a round, a small one, an empty one, and
    the manifest (the transport moves bytes only, so the contents need not parse)."""
    gen = torch.Generator().manual_seed(seed)
    os.makedirs(os.path.join(directory, "data"))
    files = {"data/0-0.safetensors": big, "data/0-1.safetensors": 777, "data/empty.bin": 0, "manifest.json": 555}
    for name, size in files.items():
        Path(directory, name).write_bytes(torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
                                          .numpy().tobytes())


def _tree(path: str | Path) -> dict[str, str]:
    """Every file under ``path`` (hidden ones included) with the sha256 of its bytes."""
    path = Path(path)
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _ring(root: str, step: int = 2) -> list[DirectoryMove]:
    """Rank r's own directory to the node of rank (r + step) % RANKS, under the same relative name."""
    return [DirectoryMove(r, _rank_dir(root, r, r), (r + step) % RANKS, _rank_dir(root, (r + step) % RANKS, r))
            for r in range(RANKS)]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _ring_move(root: str):
    """The ring, with what the transfer logger said on this rank."""
    rank = dist.get_rank()
    _write_checkpoint(_rank_dir(root, rank, rank), seed=rank)
    dist.barrier()
    logger, lines = logging.getLogger("shardkit.checkpoint.io.transfer"), _Lines()
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        return move_directories(_ring(root), round_bytes=ROUND), lines.lines
    finally:
        logger.removeHandler(lines)


def test_a_ring_of_moves_copies_every_directory_byte_for_byte(tmp_path):
    per_rank = [results for results, _ in run_on_ranks(RANKS, _ring_move, str(tmp_path))]
    for move in _ring(str(tmp_path)):
        assert _tree(move.target_dir) == _tree(move.source_dir)
        assert len(_tree(move.target_dir)) == 4
    total = 3 * ROUND + 123 + 777 + 555
    for rank, results in enumerate(per_rank):
        assert [(r.move.src, r.move.dst, r.ok, r.bytes, r.error) for r in results] == sorted(
            [(rank, (rank + 2) % RANKS, True, total, None), ((rank + 2) % RANKS, rank, True, total, None)])


def test_the_receiving_rank_logs_one_info_line_per_move(tmp_path):
    for rank, (_, lines) in enumerate(run_on_ranks(RANKS, _ring_move, str(tmp_path))):
        sender = (rank + 2) % RANKS
        assert [level for level, _ in lines] == ["INFO"]
        assert re.fullmatch(rf"received {3 * ROUND + 123 + 777 + 555} bytes in \d+\.\d{{3}} s from rank {sender} "
                            rf"into {re.escape(_rank_dir(str(tmp_path), rank, sender))}", lines[0][1])


def test_every_round_keeps_each_rank_within_round_bytes_and_moves_every_byte():
    moves = [DirectoryMove(r, "s", (r + step) % RANKS, f"t{step}") for step in (1, 2) for r in range(RANKS)]
    sizes = {i: 1000 * (i + 1) + 7 for i in range(len(moves))}
    moved = dict.fromkeys(sizes, 0)
    for grants in round_schedule(moves, sizes, 1000):
        assert grants and all(n > 0 for n in grants.values())
        for rank in range(RANKS):
            assert sum(n for i, n in grants.items() if rank in (moves[i].src, moves[i].dst)) <= 1000
        for i, n in grants.items():
            moved[i] += n
    assert moved == sizes


def test_a_schedule_makes_progress_when_round_bytes_is_smaller_than_the_moves_sharing_it():
    moves = [DirectoryMove(0, "s", dst, f"t{dst}") for dst in (1, 2, 3)]
    rounds = list(round_schedule(moves, {0: 2, 1: 1, 2: 1}, 2))
    assert rounds == [{0: 2}, {1: 1, 2: 1}]


def _move_with_a_file_deleted_after_the_first_round(root: str):
    """Rank 0's source loses a data file once its first round is read; rank 1's move runs alongside."""
    rank = dist.get_rank()
    if rank in (0, 1):
        _write_checkpoint(_rank_dir(root, rank, rank), seed=rank)
    dist.barrier()
    moves = [DirectoryMove(0, _rank_dir(root, 0, 0), 2, _rank_dir(root, 2, 0)),
             DirectoryMove(1, _rank_dir(root, 1, 1), 3, _rank_dir(root, 3, 1))]
    read_into = transfer_files.OutgoingFiles.read_into

    def read_then_lose_a_file(self, view):
        read_into(self, view)
        if os.path.exists(os.path.join(self.directory, "data/0-1.safetensors")):
            os.unlink(os.path.join(self.directory, "data/0-1.safetensors"))

    if rank != 0:
        return move_directories(moves, round_bytes=ROUND)
    with mock.patch.object(transfer_files.OutgoingFiles, "read_into", read_then_lose_a_file):
        return move_directories(moves, round_bytes=ROUND)


def test_a_source_that_fails_halfway_leaves_no_target_and_fails_on_both_ends(tmp_path):
    per_rank = run_on_ranks(RANKS, _move_with_a_file_deleted_after_the_first_round, str(tmp_path))
    failed = [r for results in per_rank for r in results if r.move.src == 0]
    assert [(r.ok, r.bytes) for r in failed] == [(False, 3 * ROUND + 123 + 777 + 555)] * 2
    lost = os.path.join(_rank_dir(str(tmp_path), 0, 0), "data/0-1.safetensors")
    assert failed[0].error == failed[1].error
    assert failed[0].error.startswith(f"rank 0 failed reading source directory {_rank_dir(str(tmp_path), 0, 0)}: ")
    assert f"cannot read {lost}" in failed[0].error
    assert os.listdir(tmp_path / "node2" / "step-00000017") == []  # no target, no staging directory left
    assert _tree(_rank_dir(str(tmp_path), 3, 1)) == _tree(_rank_dir(str(tmp_path), 1, 1))
    assert [r.ok for results in per_rank for r in results if r.move.src == 1] == [True, True]


def _move_from_a_missing_directory(root: str):
    rank = dist.get_rank()
    if rank != 1:
        _write_checkpoint(_rank_dir(root, rank, rank), seed=rank)
    dist.barrier()
    return move_directories(_ring(root), round_bytes=ROUND)


def test_a_missing_source_directory_fails_that_move_on_both_ends_and_the_others_still_run(tmp_path):
    per_rank = run_on_ranks(RANKS, _move_from_a_missing_directory, str(tmp_path))
    missing = _rank_dir(str(tmp_path), 1, 1)
    expected = (f"rank 1 cannot send source directory {missing}: source directory {missing} does not exist or is "
                f"not a directory")
    assert [(r.ok, r.bytes, r.error) for r in per_rank[1] if r.move.src == 1] == [(False, 0, expected)]
    assert [(r.ok, r.bytes, r.error) for r in per_rank[3] if r.move.src == 1] == [(False, 0, expected)]
    assert not os.path.exists(tmp_path / "node3" / "step-00000017" / "rank-1")
    for move in _ring(str(tmp_path)):
        if move.src != 1:
            assert _tree(move.target_dir) == _tree(move.source_dir)
    assert sorted(r.move.src for results in per_rank for r in results if r.ok) == [0, 0, 2, 2, 3, 3]


def _move_onto_existing_targets(root: str):
    rank = dist.get_rank()
    _write_checkpoint(_rank_dir(root, rank, rank), seed=rank)
    dist.barrier()
    return move_directories(_ring(root), round_bytes=ROUND)


def test_an_existing_committed_target_or_foreign_directory_is_never_overwritten(tmp_path):
    committed = Path(_rank_dir(str(tmp_path), 2, 0))   # rank 0's move lands here
    _write_checkpoint(str(committed), seed=99)
    foreign = Path(_rank_dir(str(tmp_path), 3, 1))     # rank 1's move lands here
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("someone else's")
    before = {"committed": _tree(committed), "foreign": _tree(foreign)}
    per_rank = run_on_ranks(RANKS, _move_onto_existing_targets, str(tmp_path))
    assert {"committed": _tree(committed), "foreign": _tree(foreign)} == before
    errors = {r.move.src: r.error for results in per_rank for r in results if not r.ok}
    assert errors == {
        0: f"rank 2 cannot receive into target directory {committed}: target directory {committed} already holds "
           f"a committed copy (manifest.json); refusing to overwrite it: remove it first or move into another "
           f"directory",
        1: f"rank 3 cannot receive into target directory {foreign}: target directory {foreign} already exists and "
           f"is not an empty directory (no manifest.json: a partial or foreign directory); refusing to write into "
           f"it: remove it first or move into another directory"}
    assert sorted(os.listdir(committed.parent)) == ["rank-0", "rank-2"]  # no staging directory left behind
    assert [r.ok for results in per_rank for r in results if r.move.src in (2, 3)] == [True] * 4


def _move_while_someone_fills_the_target(root: str, confirm: bool = True):
    """Rank 2 finds a file in its target once the copy is complete but before it is renamed into place."""
    rank = dist.get_rank()
    _write_checkpoint(_rank_dir(root, rank, rank), seed=rank)
    dist.barrier()
    finish = transfer_files.IncomingFiles.finish

    def finish_then_someone_writes(self):
        finish(self)
        Path(self.target_dir).mkdir()
        Path(self.target_dir, "manifest.json").write_text("theirs")

    if rank != 2:
        return move_directories(_ring(root), round_bytes=ROUND, confirm=confirm)
    with mock.patch.object(transfer_files.IncomingFiles, "finish", finish_then_someone_writes):
        return move_directories(_ring(root), round_bytes=ROUND, confirm=confirm)


def test_a_target_that_appears_during_the_move_is_left_as_it_is_and_the_move_fails_on_both_ends(tmp_path):
    per_rank = run_on_ranks(RANKS, _move_while_someone_fills_the_target, str(tmp_path))
    target = Path(_rank_dir(str(tmp_path), 2, 0))
    assert _tree(target) == {"manifest.json": hashlib.sha256(b"theirs").hexdigest()}
    assert sorted(os.listdir(target.parent)) == ["rank-0", "rank-2"]  # the discarded copy is gone too
    failed = [(r.move.src, r.ok) for results in per_rank for r in results if not r.ok]
    assert failed == [(0, False), (0, False)]
    assert [r.error for r in per_rank[0] if r.move.src == 0] == [r.error for r in per_rank[2] if r.move.src == 0]
    assert [r.error for r in per_rank[0] if r.move.src == 0][0].startswith(
        f"rank 2: target directory {target} appeared during the move and is not empty; it was left as it is")


def test_without_confirm_only_the_receiver_learns_that_its_copy_could_not_be_put_in_place(tmp_path):
    per_rank = run_on_ranks(RANKS, _move_while_someone_fills_the_target, str(tmp_path), False)
    target = Path(_rank_dir(str(tmp_path), 2, 0))
    assert _tree(target) == {"manifest.json": hashlib.sha256(b"theirs").hexdigest()}  # theirs, untouched
    assert sorted(os.listdir(target.parent)) == ["rank-0", "rank-2"]
    failed = [(rank, r.move.src) for rank, results in enumerate(per_rank) for r in results if not r.ok]
    assert failed == [(2, 0)]  # the receiver; the source's bytes all went out
    assert [r.error for r in per_rank[2] if r.move.src == 0][0].startswith(
        f"rank 2: target directory {target} appeared during the move and is not empty; it was left as it is")


def _count_allocations_during_a_move(root: str, round_bytes: int):
    """Two moves out and two in per rank, many rounds each; every ``torch.empty`` during the call recorded."""
    rank = dist.get_rank()
    for step in (1, 2):
        _write_checkpoint(_rank_dir(root, rank, rank) + f"-{step}", seed=rank, big=300_000)
    dist.barrier()
    moves = [DirectoryMove(m.src, m.source_dir + f"-{step}", m.dst, m.target_dir + f"-{step}")
             for step in (1, 2) for m in _ring(root, step)]
    sizes, empty = [], torch.empty

    def counting_empty(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    with mock.patch.object(torch, "empty", counting_empty):
        results = move_directories(moves, round_bytes=round_bytes)
    return results, sizes


def test_a_rank_holds_one_buffer_of_round_bytes_however_much_it_moves(tmp_path):
    round_bytes = 96 << 10  # not the size of a collective's frame (wire.collectives.frame_bytes: 64 KiB at 4 ranks)
    per_rank = run_on_ranks(RANKS, _count_allocations_during_a_move, str(tmp_path), round_bytes)
    for results, sizes in per_rank:
        assert [(r.ok, r.buffer_bytes) for r in results] == [(True, round_bytes)] * 4
        assert sum(r.bytes for r in results) == 4 * (300_000 + 777 + 555)
        assert max(sizes) == round_bytes and sizes.count(round_bytes) == 1
        # the rest: the exchanges' JSON frames, a fixed size per collective whatever the bytes moved
        assert sum(s for s in sizes if s != round_bytes) <= 3 * RANKS * (64 << 10) + 4096
    for step in (1, 2):
        for move in _ring(str(tmp_path), step):
            assert _tree(move.target_dir + f"-{step}") == _tree(move.source_dir + f"-{step}")


def _move_from_a_thread_on_a_private_group(root: str):
    rank = dist.get_rank()
    _write_checkpoint(_rank_dir(root, rank, rank), seed=rank)
    group = dist.new_group(backend="gloo")
    dist.barrier()
    try:
        with ThreadPoolExecutor(1) as background:
            return background.submit(move_directories, _ring(root), group=group, round_bytes=ROUND).result(60)
    finally:
        dist.destroy_process_group(group)


def test_a_move_runs_from_a_background_thread_on_its_own_gloo_group(tmp_path):
    per_rank = run_on_ranks(RANKS, _move_from_a_thread_on_a_private_group, str(tmp_path))
    assert [[r.ok for r in results] for results in per_rank] == [[True, True]] * RANKS
    for move in _ring(str(tmp_path)):
        assert _tree(move.target_dir) == _tree(move.source_dir)


def _bad_arguments_message(moves: list[DirectoryMove]) -> str:
    with pytest.raises(ConfigurationError) as raised:
        move_directories(moves)
    return str(raised.value)


@pytest.mark.parametrize("moves, message", [
    ([DirectoryMove(1, "/a", 1, "/b")],
     "moves[0] sends rank 1's /a to the same rank; src and dst must differ (copy the directory locally instead)"),
    ([DirectoryMove(0, "/a", 4, "/b")],
     "moves[0].dst is 4, but the process group has ranks 0..3 (ranks in a DirectoryMove are ranks of the group)"),
    ([DirectoryMove(0, "/a", 1, "/b"), DirectoryMove(0, "/c", 1, "/b")],
     "moves[0] and moves[1] both write /b on rank 1; give each move its own target"),
], ids=["same-rank", "outside-the-group", "one-target-twice"])
def test_bad_moves_raise_the_same_error_on_every_rank_before_anything_moves(moves, message):
    assert run_on_ranks(RANKS, _bad_arguments_message, moves) == [message] * RANKS


def _move_with_arguments_of_its_own(root: str):
    rank = dist.get_rank()
    return _bad_arguments_message([DirectoryMove(0, root, 1, os.path.join(root, f"target-{rank}"))])


def test_ranks_called_with_different_moves_all_raise_instead_of_waiting_for_each_other(tmp_path):
    message = ("move_directories was called with other moves, round_bytes or commit_last on ranks [1, 2, 3] than "
               "on rank 0; every rank of the group must pass the same")
    assert run_on_ranks(RANKS, _move_with_arguments_of_its_own, str(tmp_path)) == [message] * RANKS
    assert os.listdir(tmp_path) == []


def _ring_with_listings(root: str, blocked: bool):
    """The ring with the listings every rank was given up front (no exchange of its own); ``blocked``: rank
    2's target parent is a file, so it cannot receive."""
    rank = dist.get_rank()
    _write_checkpoint(_rank_dir(root, rank, rank), seed=rank)
    if blocked and rank == 2:
        Path(_rank_dir(root, 2, 0)).parent.mkdir(parents=True, exist_ok=True)
        Path(_rank_dir(root, 2, 0)).write_text("in the way")
    dist.barrier()
    listings = [[(n, size) for n, size in transfer_files.list_directory(m.source_dir, "manifest.json")]
                if m.src == rank else None for m in _ring(root)]
    gathered: list = [None] * RANKS
    dist.all_gather_object(gathered, listings)
    agreed = [gathered[m.src][i] for i, m in enumerate(_ring(root))]
    return move_directories(_ring(root), round_bytes=ROUND, listings=agreed)


def test_listings_given_up_front_move_every_directory_byte_for_byte(tmp_path):
    run_on_ranks(RANKS, _ring_with_listings, str(tmp_path), False)
    for move in _ring(str(tmp_path)):
        assert _tree(move.target_dir) == _tree(move.source_dir)


def test_with_listings_given_a_target_that_cannot_be_written_fails_that_move_on_both_ends(tmp_path):
    per_rank = run_on_ranks(RANKS, _ring_with_listings, str(tmp_path), True)
    failed = sorted((rank, r.move.src, r.move.dst) for rank, results in enumerate(per_rank) for r in results
                    if not r.ok)
    assert failed == [(0, 0, 2), (2, 0, 2)]
    assert Path(_rank_dir(str(tmp_path), 2, 0)).read_text() == "in the way"
    for move in _ring(str(tmp_path))[1:]:
        assert _tree(move.target_dir) == _tree(move.source_dir)
