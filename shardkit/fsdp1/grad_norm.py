"""FSDP1's ``clip_grad_norm_``: the runtime's, which handles every mix an
FSDP1 model produces.

An FSDP1 model can hold ``DTensor`` gradients on several meshes (a
``CustomPolicy`` gives units different strategies: a ``NO_SHARD`` unit's
replicate dim holds copies, an HSDP unit's too) and plain gradients of
ignored parameters, which every rank holds whole.  The rules for counting
each exactly once are those of :func:`shardkit.clip_grad_norm_`
(``shardkit/runtime/grad_norm.py``), so FSDP1 uses it as is.
"""

from __future__ import annotations

from shardkit.runtime.grad_norm import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
