"""Debug mode, and collectives whose failures say which module they were for.

Note [why a mismatch hangs]
    Every rank of a process group must issue the same collectives in the same
    order.  A rank that skips a module's forward (a data-dependent branch),
    runs modules in another order, or reduces a gradient its peers do not
    have breaks that, and the job does not fail: same-sized collectives pair
    up silently with the wrong peers' data, and eventually some rank waits
    in a collective nobody else joins, until the process-group timeout (tens
    of minutes on NCCL).  The error then names a sequence number, not a module.

Debug mode (``SHARDKIT_DEBUG=1`` in the environment, or
``shardkit.set_debug(True)``) checks before each collective the runtime
issues: the ranks of its process group all-gather a fixed-size fingerprint of
it (FSDP group FQN, op, element count, dtype, pass).  The exchange has the
same size on every rank, so it cannot itself mismatch; if the fingerprints
differ, every rank raises :class:`~shardkit.errors.CollectiveMismatchError`
naming what each rank was about to do.  The cost is one small all-gather per
collective (``benchmarks/runtime.py`` measures it).

Without debug mode nothing is exchanged, but a collective that fails (a
timeout, a peer that died) is re-raised as
:class:`~shardkit.errors.CollectiveError` naming the group, op and pass, with
the backend's error chained.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from shardkit.errors import CollectiveError, CollectiveMismatchError
from shardkit.runtime.gather_scatter import issue_all_gather

__all__ = ["CollectiveCall", "set_debug", "debug_enabled", "check_same_collective", "collective", "naming_failures"]

log = logging.getLogger("shardkit.runtime.debug")

_FINGERPRINT_BYTES = 256
_override: bool | None = None


def set_debug(enabled: bool | None) -> None:
    """Turn debug mode on or off for this process; ``None`` goes back to the
    ``SHARDKIT_DEBUG`` environment variable.

    Every rank must use the same setting: the check is itself a collective."""
    global _override
    _override = None if enabled is None else bool(enabled)
    log.info("shardkit debug mode %s", "follows SHARDKIT_DEBUG" if enabled is None else
             "on: collectives are checked across ranks before they run" if enabled else "off")


def debug_enabled() -> bool:
    if _override is not None:
        return _override
    return os.environ.get("SHARDKIT_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class CollectiveCall:
    """One collective the runtime is about to issue, as the ranks must agree on it."""

    group: str        # the FSDP group: the FQN of the module(s) of one fully_shard call
    op: str           # "all-gather", "reduce-scatter", "all-reduce"
    numel: int        # elements this rank sends (all-gather: its block; others: the whole buffer)
    dtype: torch.dtype
    phase: str        # "forward", "backward", "explicit unshard"

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.op} of group '{self.group}' in {self.phase} ({self.numel} x {dtype})"

    def fingerprint(self) -> bytes:
        text = self.describe().encode()
        if len(text) > _FINGERPRINT_BYTES:  # keep it unique: a long FQN ends in a hash of the whole
            text = text[:_FINGERPRINT_BYTES - 17] + b"~" + hashlib.sha1(text).hexdigest()[:16].encode()
        return text


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def check_same_collective(call: CollectiveCall, group: dist.ProcessGroup, device: torch.device) -> None:
    """Exchange ``call``'s fingerprint over ``group``; raise on every rank if they differ."""
    mine = torch.zeros(_FINGERPRINT_BYTES, dtype=torch.uint8)
    text = call.fingerprint()
    mine[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    size = group.size()
    gathered = torch.empty(size * _FINGERPRINT_BYTES, dtype=torch.uint8, device=device)
    with naming_failures(call, group, what="the debug check before the "):
        issue_all_gather(gathered, mine.to(device), group, async_op=False)
    rows = gathered.cpu().view(size, _FINGERPRINT_BYTES).numpy()
    seen = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows]
    if len(set(seen)) > 1:
        ranks = _ranks(group)
        sides = "; ".join(f"rank {r}: {text}" for r, text in zip(ranks, seen))
        raise CollectiveMismatchError(
            f"ranks {ranks} were about to run different collectives: {sides}. Every rank must run the same "
            "sharded modules in the same order, forward and backward (a rank skipped, repeated or reordered "
            "a module, or reduces a gradient its peers do not have: see set_reduce_scatter_unused_params)"
        )


@contextlib.contextmanager
def naming_failures(call: CollectiveCall, group: dist.ProcessGroup, what: str = "") -> Iterator[None]:
    """Re-raise a backend failure inside the block as a ``CollectiveError`` naming ``call``."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"{what}{call.describe()} over ranks {_ranks(group)} failed on rank {rank}: {reason} (a timeout "
            "usually means a rank skipped, repeated or reordered a sharded module's forward or backward and "
            "left its peers waiting; rerun with SHARDKIT_DEBUG=1 to see what each rank was doing)"
        ) from exc


@contextlib.contextmanager
def collective(call: CollectiveCall, group: dist.ProcessGroup, device: torch.device) -> Iterator[None]:
    """Around issuing one collective: the debug check first (when on), then
    failures named after ``call``."""
    if debug_enabled():
        check_same_collective(call, group, device)
    with naming_failures(call, group):
        yield
