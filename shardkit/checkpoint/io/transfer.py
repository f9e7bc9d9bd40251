"""Move whole checkpoint directories between ranks over a process group, in bounded memory.

The hot tier keeps each rank's latest shards as a small native checkpoint in its node's local
directory and copies that directory, byte for byte, to ranks on other nodes (and back at recovery).
:func:`move_directories` is that copy: a collective every rank of the group calls with the same list
of moves.  It moves bytes only; the manifest's checksums verify the copy later.

How one call runs, and why:

1. **Listings.**  Every source lists its directory (relative names and sizes) and every receiver
   checks its target; one small JSON all-gather shares the answers, so every rank knows every move's
   size and which moves already failed -- a source that cannot read its directory fails that move on
   both ends without anyone waiting for bytes that will never come.
2. **Rounds.**  The ranks derive the same schedule from the listings: in each round every rank has at
   most ``round_bytes`` in flight, sends and receives together, shared fairly between the moves it
   takes part in.  A round is one batch of ``isend``/``irecv``, so rings (r -> r+2 while r+2 -> r)
   cannot deadlock, and it goes through the one transfer buffer a rank holds for the whole call.
   Receivers write each round into a staging directory as it lands (``transfer_files.py``).
3. **Outcome.**  A second all-gather reports what went wrong during the rounds (a file that changed
   under its reader, a full disk), so a receiver commits -- the commit file last, then one rename of the
   staging directory -- only copies whose source read every byte; a third reports the commits, so both
   ends of a move return the same verdict (left out with ``confirm=False``).

A failed move never raises: the caller (which knows the other replicas) decides.  Only arguments that
no rank could run raise, identically on every rank, before any byte moves.  Ranks in a move are ranks
of ``group``; the call may run on a background thread when ``group`` is that thread's own group (gloo
aborts when two threads use one group at once).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Sequence

import torch

from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.names import check_name
from shardkit.checkpoint.io.rounds import ROUND_BYTES
from shardkit.checkpoint.io.transfer_buffer import TransferBuffer
from shardkit.checkpoint.io.transfer_files import IncomingFiles, OutgoingFiles, check_target, list_directory
from shardkit.errors import ArgumentTypeError, ConfigurationError

__all__ = ["DirectoryMove", "MoveResult", "move_directories", "round_schedule"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DirectoryMove:
    """Send the files of ``source_dir`` on rank ``src`` to ``target_dir`` on rank ``dst`` (local paths)."""
    src: int
    source_dir: str  # meaningful on src only
    dst: int
    target_dir: str  # meaningful on dst only


@dataclass(frozen=True)
class MoveResult:
    """How one move ended, on one of its two ranks.  ``bytes`` counts what this rank sent or received for it
    (all of the directory once the listings agreed, even where the copy then failed, 0 where they did not);
    ``buffer_bytes`` is the size of the one transfer buffer this rank held for the whole call (never more
    than ``round_bytes``: the bound on the memory a move takes, whatever the size of its files)."""
    move: DirectoryMove
    ok: bool
    bytes: int
    seconds: float
    error: str | None
    buffer_bytes: int


def move_directories(moves: Sequence[DirectoryMove], *, group: Any = None, round_bytes: int = ROUND_BYTES,
                     commit_last: str = "manifest.json", confirm: bool = True,
                     listings: Sequence[Sequence[tuple[str, int]]] | None = None) -> list[MoveResult]:
    """Copy each move's directory from its source rank to its target rank; collective over ``group``.

    Returns one :class:`MoveResult` per move this rank sends or receives, in ``moves`` order.  A move
    whose source cannot be read, whose target already holds anything, or whose bytes do not all arrive
    and land on disk ends with ``ok=False`` and the reason (naming the directory and rank) on both its
    ranks; the others still run.  Raises :class:`~shardkit.errors.ConfigurationError` only for arguments
    that cannot run (the same on every rank).

    ``confirm=False`` leaves out step 3's last all-gather: a receiver that fails to rename its copy into
    place says so in its own result only, and the source's result says the bytes were sent.  For callers
    whose ranks exchange their outcomes right after anyway (the hot tier's vote, a recovery's check), so the
    verdict reaches every rank with one collective fewer.

    ``listings`` (one per move: each file's relative name and size, the commit file last), when every rank
    already holds the same ones -- a caller that exchanged them with its own reports -- replaces step 1's
    all-gather: a target that cannot be written then fails its move at its receiver, reported in step 3
    like a failure during the rounds, and a source file shorter than listed fails as one that changed.
    """
    dist_ = Dist(group)
    dist_.phase = "replicate"
    _check_arguments(moves, dist_.group_size, round_bytes, commit_last)
    started = time.monotonic()
    me = dist_.group_rank
    incoming: dict[int, IncomingFiles] = {}
    outgoing: dict[int, OutgoingFiles] = {}
    try:
        local_errors: dict[int, str] = {}
        if listings is None:
            listings, errors = _exchange_listings(dist_, moves, round_bytes, commit_last, incoming)
        else:
            listings, errors = _given_listings(me, moves, listings, commit_last, incoming, local_errors)
        live = {i: sum(size for _, size in listings[i]) for i in range(len(moves)) if i not in errors}
        outgoing.update({i: OutgoingFiles(moves[i].source_dir, listings[i]) for i in live if moves[i].src == me})
        for i in live:
            if moves[i].dst == me and i not in local_errors:
                try:
                    incoming[i].expect(listings[i])
                except Exception as exc:  # noqa: BLE001 - this move fails; its rounds still run
                    local_errors[i] = f"rank {me} refused the listing for {moves[i].target_dir}: {exc}"
        mine = [i for i in live if me in (moves[i].src, moves[i].dst)]
        buffer = TransferBuffer(min(round_bytes, sum(live[i] for i in mine)),
                                dist_.device() if dist_.active else torch.device("cpu"))
        with dist_.rounds():  # every rank checks in once; each transfer is waited for within the deadline
            _run_rounds(dist_, moves, live, round_bytes, outgoing, incoming, buffer, local_errors)
        local_errors.update(_finish(me, incoming, local_errors, live))
        errors.update(_gather_errors(dist_, local_errors))
        published = _publish(me, incoming, errors)
        errors.update(_gather_errors(dist_, published) if confirm else published)
    finally:
        for source in outgoing.values():
            source.close()
        for target in incoming.values():
            target.discard()  # every copy not published: ours alone, never the target
    return _results(moves, me, live, errors, buffer.nbytes, started)


def round_schedule(moves: Sequence[DirectoryMove], sizes: dict[int, int], round_bytes: int) -> Iterator[dict[int, int]]:
    """For each round, how many bytes each unfinished move (by index) sends in it; every rank derives the same.

    A rank's budget per round is ``round_bytes`` for all its sends and receives together.  First every
    move gets a fair share (the budget split evenly between the moves at its busier end), then what is
    left is handed out in move order, so every round makes progress even when ``round_bytes`` is tiny.
    """
    remaining = {i: n for i, n in sizes.items() if n > 0}
    while remaining:
        users: dict[int, int] = {}
        for i in remaining:
            for rank in (moves[i].src, moves[i].dst):
                users[rank] = users.get(rank, 0) + 1
        budget = {rank: round_bytes for rank in users}
        grant = {}
        for i, left in remaining.items():
            src, dst = moves[i].src, moves[i].dst
            grant[i] = min(left, round_bytes // users[src], round_bytes // users[dst])
            budget[src] -= grant[i]
            budget[dst] -= grant[i]
        for i, left in remaining.items():
            src, dst = moves[i].src, moves[i].dst
            extra = min(left - grant[i], budget[src], budget[dst])
            grant[i] += extra
            budget[src] -= extra
            budget[dst] -= extra
        yield {i: n for i, n in grant.items() if n > 0}
        remaining = {i: left - grant[i] for i, left in remaining.items() if left > grant[i]}


def _check_arguments(moves: Sequence[DirectoryMove], group_size: int, round_bytes: int, commit_last: str) -> None:
    """Every argument that no rank could run, refused before any collective (so on every rank alike)."""
    if not isinstance(round_bytes, int) or isinstance(round_bytes, bool) or round_bytes < 1:
        raise ConfigurationError(f"round_bytes must be a positive number of bytes, got {round_bytes!r}")
    check_name(commit_last, "commit_last")
    targets = {}
    for i, move in enumerate(moves):
        if not isinstance(move, DirectoryMove):
            raise ArgumentTypeError(f"moves[{i}] is a {type(move).__name__}, not a DirectoryMove")
        for field in ("src", "dst"):
            rank = getattr(move, field)
            if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < group_size:
                raise ConfigurationError(f"moves[{i}].{field} is {rank!r}, but the process group has ranks "
                                         f"0..{group_size - 1} (ranks in a DirectoryMove are ranks of the group)")
        for field in ("source_dir", "target_dir"):
            if not isinstance(getattr(move, field), str) or not getattr(move, field):
                raise ConfigurationError(f"moves[{i}].{field} must be a non-empty local path, got "
                                         f"{getattr(move, field)!r}")
        if move.src == move.dst:
            raise ConfigurationError(f"moves[{i}] sends rank {move.src}'s {move.source_dir} to the same rank; "
                                     f"src and dst must differ (copy the directory locally instead)")
        if (move.dst, move.target_dir) in targets:
            raise ConfigurationError(f"moves[{targets[move.dst, move.target_dir]}] and moves[{i}] both write "
                                     f"{move.target_dir} on rank {move.dst}; give each move its own target")
        targets[move.dst, move.target_dir] = i


def _exchange_listings(dist_: Dist, moves: Sequence[DirectoryMove], round_bytes: int, commit_last: str,
                       incoming: dict[int, IncomingFiles]) -> tuple[dict[int, list], dict[int, str]]:
    """Step 1: every source's listing and every target's readiness, on every rank.  Receivers open their
    staging directories here (into ``incoming``) so that a target that cannot be written fails before any
    byte is sent.  Also checks that every rank called with the same arguments: different schedules
    would leave ranks waiting for each other until the group times out."""
    me = dist_.group_rank
    report: dict[str, Any] = {}
    for i, move in enumerate(moves):
        if move.src == me:
            try:
                report[str(i)] = {"files": list_directory(move.source_dir, commit_last)}
            except Exception as exc:  # noqa: BLE001 - reported to both ends as this move's failure
                report[str(i)] = {"error": f"rank {me} cannot send source directory {move.source_dir}: {exc}"}
        elif move.dst == me:
            try:
                check_target(move.target_dir, commit_last)
                incoming[i] = IncomingFiles(move.target_dir, commit_last)
                report[str(i)] = {"ready": True}
            except Exception as exc:  # noqa: BLE001 - reported to both ends as this move's failure
                report[str(i)] = {"error": f"rank {me} cannot receive into target directory {move.target_dir}: "
                                           f"{exc}"}
    digest = hashlib.sha256(json.dumps([[asdict(m) for m in moves], round_bytes, commit_last]).encode()).hexdigest()
    gathered = dist_.all_gather_json({"arguments": digest, "moves": report})
    differing = [rank for rank, answer in enumerate(gathered) if answer["arguments"] != gathered[0]["arguments"]]
    if differing:
        raise ConfigurationError(f"move_directories was called with other moves, round_bytes or commit_last on "
                                 f"ranks {differing} than on rank 0; every rank of the group must pass the same")
    listings, errors = {}, {}
    for i, move in enumerate(moves):
        sent, ready = gathered[move.src]["moves"][str(i)], gathered[move.dst]["moves"][str(i)]
        if "error" in sent or "error" in ready:
            errors[i] = "; ".join(answer["error"] for answer in (sent, ready) if "error" in answer)
        else:
            listings[i] = [(name, int(size)) for name, size in sent["files"]]
    return listings, errors


def _given_listings(me: int, moves: Sequence[DirectoryMove], given: Sequence[Sequence[tuple[str, int]]],
                    commit_last: str, incoming: dict[int, IncomingFiles],
                    local_errors: dict[int, str]) -> tuple[dict[int, list], dict[int, str]]:
    """Step 1 without a collective: the caller's listings, and this rank's targets opened (a failure is this
    rank's alone until step 3 reports it)."""
    if len(given) != len(moves):
        raise ConfigurationError(f"listings has {len(given)} entries for {len(moves)} moves; give one per move")
    listings = {i: [(str(name), int(size)) for name, size in files] for i, files in enumerate(given)}
    for i, move in enumerate(moves):
        if move.dst == me:
            try:
                check_target(move.target_dir, commit_last)
                incoming[i] = IncomingFiles(move.target_dir, commit_last)
            except Exception as exc:  # noqa: BLE001 - this move fails; its rounds still run
                local_errors[i] = f"rank {me} cannot receive into target directory {move.target_dir}: {exc}"
    return listings, {}


def _run_rounds(dist_: Dist, moves: Sequence[DirectoryMove], live: dict[int, int], round_bytes: int,
                outgoing: dict[int, OutgoingFiles], incoming: dict[int, IncomingFiles],
                buffer: TransferBuffer, failed: dict[int, str]) -> None:
    """Step 2: every round of the schedule, on every rank (a rank with no part in a round skips it).
    A move whose disk end fails keeps its place in the rounds -- its peer is already committed to them --
    but its bytes are no longer read or written; the failure is added to ``failed`` for step 3."""
    import torch.distributed as dist

    me = dist_.group_rank
    for grants in round_schedule(moves, live, round_bytes):
        ops, landing, start = [], [], 0
        for i, n in grants.items():
            move = moves[i]
            if move.src == me:
                if i not in failed:
                    try:
                        outgoing[i].read_into(buffer.view[start:start + n])
                    except Exception as exc:  # noqa: BLE001 - this move fails; the rounds go on
                        failed[i] = f"rank {me} failed reading source directory {move.source_dir}: {exc}"
                ops.append(dist.P2POp(dist.isend, buffer.outgoing(start, n), group=dist_.group,
                                      group_peer=move.dst, tag=i))
            elif move.dst == me:
                ops.append(dist.P2POp(dist.irecv, buffer.wire[start:start + n], group=dist_.group,
                                      group_peer=move.src, tag=i))
                landing.append((i, start, n))
            else:
                continue
            start += n
        dist_.exchange(ops)
        for i, begin, n in landing:
            if i not in failed:
                try:
                    incoming[i].write(buffer.landed(begin, n))
                except Exception as exc:  # noqa: BLE001 - this move fails; the rounds go on
                    failed[i] = f"rank {me} failed writing into target directory {moves[i].target_dir}: {exc}"


def _finish(me: int, incoming: dict[int, IncomingFiles], failed: dict[int, str],
            live: dict[int, int]) -> dict[int, str]:
    """Complete every staging directory whose bytes all landed (commit file last, all fsynced)."""
    more = {}
    for i, files in incoming.items():
        if i in live and i not in failed:
            try:
                files.finish()
            except Exception as exc:  # noqa: BLE001 - this move fails
                more[i] = f"rank {me} failed completing the copy for {files.target_dir}: {exc}"
    return more


def _publish(me: int, incoming: dict[int, IncomingFiles], errors: dict[int, str]) -> dict[int, str]:
    """Rename each complete copy into place, now that its source confirmed every byte it sent."""
    failed = {}
    for i in list(incoming):
        if i not in errors:
            try:
                incoming[i].publish()
                del incoming[i]
            except Exception as exc:  # noqa: BLE001 - this move fails; its staging directory is discarded
                failed[i] = f"rank {me}: {exc}"
    return failed


def _gather_errors(dist_: Dist, errors: dict[int, str]) -> dict[int, str]:
    """Every rank's failures of this step, on every rank, so both ends of a move agree."""
    merged: dict[int, str] = {}
    for answer in dist_.all_gather_json({str(i): message for i, message in errors.items()}):
        for i, message in answer.items():
            merged[int(i)] = f"{merged[int(i)]}; {message}" if int(i) in merged else message
    return merged


def _results(moves: Sequence[DirectoryMove], me: int, live: dict[int, int], errors: dict[int, str],
             buffer_bytes: int, started: float) -> list[MoveResult]:
    seconds = time.monotonic() - started
    results = []
    for i, move in enumerate(moves):
        if me not in (move.src, move.dst):
            continue
        error = errors.get(i)
        result = MoveResult(move, error is None, live.get(i, 0), seconds, error, buffer_bytes)
        results.append(result)
        if me == move.dst:
            if error is None:
                log.info("received %d bytes in %.3f s from rank %d into %s", result.bytes, seconds, move.src,
                         move.target_dir)
            else:
                log.warning("move from rank %d into %s failed after %.3f s: %s", move.src, move.target_dir,
                            seconds, error)
    return results
