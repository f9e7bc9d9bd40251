"""A torchrun restart that would hang, refused in seconds with its fix named.

Under ``torchrun --max-restarts N`` torch shares its rendezvous store with the
workers by default, and a restarted attempt's ``init_process_group`` then reads
the previous attempt's addresses from that store and hangs with no output
(torch #135712): the job neither trains nor resumes from its checkpoints.  The
hang is inside torch, before any checkpoint call, so the check runs where a
training script reaches shardkit first: when ``shardkit.checkpoint`` is
imported (scripts import it before they form their process group) and when a
``CheckpointManager`` is built.  On the first attempt it warns once (rank 0);
on a restarted attempt that has no process group yet it raises
:class:`~shardkit.errors.ConfigurationError` naming
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.  A launch without restarts, or with
the store not shared, is left alone.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Mapping

from shardkit.errors import ConfigurationError

__all__ = ["restart_hazard", "check_restartable"]

log = logging.getLogger(__name__)

_warned = False


def restart_hazard(environ: Mapping[str, str] | None = None) -> str | None:
    """What is wrong when this process runs under torchrun with restarts (``--max-restarts`` > 0) and the
    rendezvous store shared with the workers (torch's default); ``None`` when the launch is restartable (or
    not torchrun's)."""
    env = os.environ if environ is None else environ
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        restarts = 0
    if restarts < 1 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" \
            or env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return None
    return (f"torchrun restarts this job (--max-restarts {restarts}) but shares its rendezvous store with the "
            f"workers, so a restarted attempt hangs in init_process_group with no output (torch #135712) and "
            f"never resumes from its checkpoints: launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
            f"torchrun's environment (e.g. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts "
            f"{restarts} ...)")


def check_restartable(environ: Mapping[str, str] | None = None) -> None:
    """Warn once (rank 0) on the first attempt of a launch :func:`restart_hazard` finds wrong; refuse a
    restarted attempt that has not formed its process group yet, which would otherwise hang."""
    global _warned
    env = os.environ if environ is None else environ
    problem = restart_hazard(env)
    if problem is None:
        return
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist = sys.modules.get("torch.distributed")  # not imported yet: no process group formed either
    formed = dist is not None and dist.is_available() and dist.is_initialized()
    if attempt not in ("", "0") and not formed:
        raise ConfigurationError(f"attempt {attempt} of this job: {problem}")
    if not _warned and env.get("RANK", "0") == "0":
        _warned = True
        log.warning("%s", problem)
