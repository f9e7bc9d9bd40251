"""The three checkpoint systems the peer benchmarks compare, each configured once, here, on its natural runtime.

``benchmarks/peers.py`` (save / load / resharding load / async blocking) and ``benchmarks/goodput.py`` (time
lost to checkpointing in a training loop) both go through this module, so a system is configured the same way
in both and the printed ``CONFIGURATION`` says how and why:

* **shardkit**: the model under ``shardkit.fully_shard``; ``shardkit.checkpoint.save/load/async_save`` with
  their defaults (data files with ``O_DIRECT``, ``fsync`` of every file and directory before the commit,
  crc32c checked on every read); the state dict is ``get_training_state(model, optimizer)``.
* **DCP**: the model under torch's ``torch.distributed.fsdp.fully_shard``; ``dcp.save/load/async_save`` with
  their defaults (``FileSystemWriter``: one file per rank, ``sync_files=True`` so it fsyncs, one thread;
  ``async_save``: its background thread); the state dict is ``get_state_dict(model, optimizer)``.
* **torch_checkpointing** 0.1.1 (Meta): the same torch ``fully_shard`` model and ``get_state_dict`` state,
  ``CheckpointManager`` with a ``DefaultResharder`` per item (how torchtitan's backend uses it).  On CPU:
  ``LocalFileSystemStorageConfig(use_direct_io=False)`` (its direct I/O path needs aligned CUDA-pinned
  staging; its reader still tries ``O_DIRECT`` first and, refused, warns once and reads buffered from then
  on); its metadata all-gather, ``DefaultMetadataManager._all_gather_pickled_data``, builds tensors on
  ``device="cuda"`` unconditionally, so :func:`install_torch_checkpointing_cpu` replaces that one method in
  the benchmark's processes by the same exchange through ``all_gather_object`` on the gloo group (same input,
  same ``{rank: metadata}`` output).  Sync saves: ``Config.with_sync_save()``.  Async saves:
  ``Config.with_async_save()`` works on CPU as it is -- its stager turns pinned memory and non-blocking
  copies off by itself when CUDA is absent and stages into shared memory on a background thread for its
  writer subprocess (spawned; the launching script needs a ``__main__`` guard) -- with the subprocess's
  start-up timeout raised from 30 s to 300 s (a busy 2-core machine starts a spawned torch process slower).
  It does not fsync: its "durable" save here is the save followed by ``fsync`` of every file it wrote and
  of the step's directory and the root (what a durable save must do; ``--tc-durable sync`` uses the
  ``os.sync()`` of the issue instead).  Its async "blocking" time is ``save()`` plus ``with manager.lock():``
  -- the moment the training loop may change the state again (its staging runs after ``save()`` returns).
  Each sync save and each load uses a manager made for it (timed with the op; making one costs well under a
  millisecond): in 0.1.1 a second sync save through the same manager writes no ``metadata.pkl`` (its
  metadata manager hands the cached metadata back as ``None``), and that step cannot be resharded ("Target
  value ... is set to Tensor, but source value is DTensor"); the async saver's subprocess keeps the metadata
  and writes it every time, so one async manager serves every async save.

On CUDA (``benchmarks/peers.py --device cuda``): NCCL, one GPU per rank (``LOCAL_RANK``), every model moved
to its GPU and then sharded over a CUDA device mesh by its runtime's ``fully_shard``, every load into the GPU
tensors; each system staged into page-locked host memory, as its documentation recommends for CUDA:

* **shardkit**: ``async_save`` as it is -- it page-locks its reused host buffer (``cudaHostRegister``) as
  soon as the state is on CUDA and copies device-to-host on a side stream; ``save``/``load`` as on CPU.
* **DCP**: ``async_save(..., async_stager=DefaultStager(StagingOptions(use_pinned_memory=True,
  use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True)))``, one stager for every
  save (its pinned buffers are reused; the same stager as ``benchmarks/checkpoint_cuda.py``).  Its staging
  finishes in the background: the "blocking" time runs to ``staging_completion``.
* **torch_checkpointing**: ``CheckpointStagerConfig(use_pinned_memory=True, use_shared_memory=True,
  use_async_staging=True, use_non_blocking_copy=True)`` -- its CUDA defaults, written out -- and its own
  metadata all-gather on NCCL (no replacement).  Direct I/O (``use_direct_io=True``, its default) only where
  the checkpoint directory takes its O_DIRECT writes: it opens data files ``O_DIRECT`` and ``torch.save``s
  into them through a buffered file, so ext4 and XFS refuse the unaligned writes (``EINVAL``) whatever the
  staging; :func:`tc_direct_io_works` tries one such write in the directory first and the report says
  which way it went.
* Every time is taken between ``torch.cuda.synchronize()`` calls, so copies still in flight on any stream
  count against the system that started them.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

SYSTEMS = ("shardkit", "dcp", "torch_checkpointing")
LABEL = {"shardkit": "shardkit", "dcp": "DCP", "torch_checkpointing": "torch_ckpt", "raw": "raw"}
CONFIGURATION = __doc__.split("\n\n", 2)[2]


# -- the model: a LLaMA-shaped stack of SwiGLU MLP blocks, fp32, and its AdamW state --------------------------


class Block(torch.nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(dim))
        self.w1 = torch.nn.Linear(dim, ffn, bias=False)
        self.w2 = torch.nn.Linear(ffn, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


def shape_for(nbytes: float) -> tuple[int, int, int]:
    """(dim, ffn, layers) whose weights + two AdamW moments (12 bytes a parameter) come nearest ``nbytes``."""
    dim = 128 if nbytes < 20e6 else 512 if nbytes < 200e6 else 1024
    ffn = 64 * round(8 * dim / 3 / 64)
    per_layer = 12 * (3 * dim * ffn + dim)
    return dim, ffn, max(1, round(nbytes / per_layer))


def build(nbytes: float, runtime: str | None, seed: int = 0,
          device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (``runtime``: ``"shardkit"``, ``"torch"`` or ``None`` for unsharded) after one AdamW step.

    ``device="cuda"``: the same values (made on the CPU from ``seed``), moved to the current GPU and sharded
    over a CUDA mesh of the default group, so every runtime starts from the same weights."""
    dim, ffn, layers = shape_for(nbytes)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[Block(dim, ffn) for _ in range(layers)])
    kwargs: dict[str, Any] = {}
    if device != "cpu":
        model = model.to(device)
        if runtime is not None:
            from torch.distributed.device_mesh import init_device_mesh

            kwargs["mesh"] = init_device_mesh(device, (dist.get_world_size(),))
    if runtime is not None:
        if runtime == "shardkit":
            from shardkit import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        for block in model:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, dim).to(device)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def runtime_of(system: str) -> str:
    return "shardkit" if system == "shardkit" else "torch"


def state_of(system: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The state dict ``system`` saves and loads: shardkit's ``get_training_state`` or torch's ``get_state_dict``."""
    if system == "shardkit":
        import shardkit.checkpoint as skc

        return skc.get_training_state(model, opt)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict by a dotted key (lists by index)."""
    out: dict[str, torch.Tensor] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        else:
            out.update(tensors(value, name + "."))
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes_of(state: dict[str, Any]) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors(state).values())


# -- torch_checkpointing on CPU ---------------------------------------------------------------------------------


def _gloo_gather(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
    out: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, data, group=process_group)
    return dict(enumerate(out))


def install_torch_checkpointing_cpu() -> None:
    """Replace torch_checkpointing's CUDA-only metadata all-gather in this process (module docstring)."""
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    DefaultMetadataManager._all_gather_pickled_data = _gloo_gather


def tc_manager(async_save: bool, device: str = "cpu", direct_io: bool = False) -> Any:
    """A torch_checkpointing ``CheckpointManager`` configured for ``device`` (module docstring)."""
    return tc_config(async_save, device, direct_io).build()


def tc_config(async_save: bool, device: str = "cpu", direct_io: bool = False) -> Any:
    """The ``CheckpointManager.Config`` of :func:`tc_manager`; ``direct_io`` only counts on CUDA, and only
    where :func:`tc_direct_io_works` said so."""
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    config = CheckpointManager.Config.with_async_save() if async_save else CheckpointManager.Config.with_sync_save()
    if async_save:
        config.save.process_config.subprocess_init_timeout_secs = 300
        if device != "cpu":
            from torch_checkpointing.staging import CheckpointStagerConfig

            config.save.staging_config = CheckpointStagerConfig(use_pinned_memory=True, use_shared_memory=True,
                                                                use_async_staging=True, use_non_blocking_copy=True)
    config.items = {"model": ItemSpec(resharder=DefaultResharder()), "optim": ItemSpec(resharder=DefaultResharder())}
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=direct_io and device != "cpu")
    return config


def tc_direct_io_works(folder: str) -> bool:
    """Whether torch_checkpointing's direct-I/O write (``O_DIRECT`` open, ``torch.save`` through a buffered
    file) succeeds in ``folder``: one small tensor written, read back and compared, the file removed."""
    from torch_checkpointing.storage.filesystem import WriteStream

    path = os.path.join(folder, f".tc-direct-io-probe-{os.getpid()}.pt")
    probe = torch.arange(1000, dtype=torch.float32)
    try:
        with WriteStream(path, "wb", use_direct_io=True) as f:
            direct = f.using_direct_io
            torch.save({"probe": probe}, f)
        return direct and torch.equal(torch.load(path, weights_only=True)["probe"], probe)
    except OSError:
        return False
    finally:
        if os.path.exists(path):
            os.remove(path)


def dcp_pinned_stager() -> Any:
    """DCP's page-locked background stager (module docstring), made once and reused for every save."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=True))


def fsync_tc_step(path: str, rank: int, how: str = "fsync") -> None:
    """Make a torch_checkpointing step durable: this rank's files (rank 0: also the metadata, the step's
    directory and its parent) fsynced, or (``how="sync"``) ``os.sync()``."""
    if how == "sync":
        os.sync()
        return
    if dist.is_initialized():
        dist.barrier()  # rank 0 renames the temporary step directory after its own barrier: wait for that
    names = [n for n in os.listdir(path) if n.endswith(f"_{rank}.pt") or (rank == 0 and not n.endswith(".pt"))]
    for name in names:
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for folder in ([path, os.path.dirname(path.rstrip("/"))] if rank == 0 else []):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- one operation of one system ---------------------------------------------------------------------------------


class Peers:
    """The three systems' save, load and async save on one process, with their managers made once."""

    def __init__(self, tc_durable: str = "fsync", async_group: Any = None, device: str = "cpu",
                 tc_direct_io: bool = False) -> None:
        if device == "cpu":
            install_torch_checkpointing_cpu()
        self.tc_async: Any = None  # made on first use: it spawns a writer process
        self.tc_durable = tc_durable
        self.group = async_group
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = device
        self.tc_direct_io = tc_direct_io
        self.dcp_stager: Any = None  # CUDA only: made on first use, reused

    def save(self, system: str, state: dict[str, Any], path: str) -> None:
        """A durable save: committed and on disk when it returns."""
        self._blocking("save", system, state, path)
        if system == "torch_checkpointing":
            fsync_tc_step(path, self.rank, self.tc_durable)

    def load(self, system: str, state: dict[str, Any], path: str) -> None:
        """Load ``path`` into ``state``'s tensors in place."""
        self._blocking("load", system, state, path)

    def _blocking(self, op: str, system: str, state: dict[str, Any], path: str) -> None:
        """``op`` ("save" or "load") of ``state`` at ``path`` through ``system``'s own blocking call."""
        if system == "shardkit":
            import shardkit.checkpoint as skc

            getattr(skc, op)(state, path)
        elif system == "dcp":
            import torch.distributed.checkpoint as dcp

            getattr(dcp, op)(state, checkpoint_id=path)
        else:
            manager = tc_manager(False, self.device, self.tc_direct_io)  # fresh: see the module docstring
            try:
                if op == "save":
                    manager.save(path, state)
                else:
                    manager.load(path, into=state)
            finally:
                manager.close()

    def async_save(self, system: str, state: dict[str, Any], path: str) -> Callable[[], None]:
        """Start an async save; returns once the caller may change ``state`` again, with the wait for the
        commit (a callable)."""
        if system == "shardkit":
            import shardkit.checkpoint as skc

            future = skc.async_save(state, path, process_group=self.group)
            return future.result
        if system == "dcp":
            import torch.distributed.checkpoint as dcp

            if self.device == "cpu":
                future = dcp.async_save(state, checkpoint_id=path, process_group=self.group)
                return future.result
            if self.dcp_stager is None:
                self.dcp_stager = dcp_pinned_stager()
            response = dcp.async_save(state, checkpoint_id=path, process_group=self.group,
                                      async_stager=self.dcp_stager)
            if hasattr(response, "upload_completion"):  # staged in the background: the state is free after it
                response.staging_completion.result()
                return response.upload_completion.result
            return response.result
        if self.tc_async is None:
            self.tc_async = tc_manager(True, self.device, self.tc_direct_io)
        future = self.tc_async.save(path, state)
        with self.tc_async.lock():  # staging runs after save() returns: wait until the state may change
            pass
        return future.result

    def close(self) -> None:
        if self.tc_async is not None:
            self.tc_async.close()
        if self.dcp_stager is not None:
            self.dcp_stager.close()


def parse_size(text: str) -> float:
    """``"5MB"``, ``"1.4GB"``, ``"300M"`` -> bytes (decimal units)."""
    text = text.strip().upper().rstrip("B")
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:], 1.0)
    value = float(text[:-1] if text[-1:] in "KMG" else text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"not a size: {text!r}")
    return value * scale
