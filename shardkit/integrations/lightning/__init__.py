"""shardkit as the checkpoint engine of Lightning 2.6: ``ShardkitStrategy`` (Trainer), ``ShardkitFabricStrategy``.

    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=ShardkitStrategy())

=============  ================================================================
``strategy``   ``ShardkitStrategy``: Lightning's ``ModelParallelStrategy``
               (``configure_model`` + ``self.device_mesh``) saving and loading
               through ``shardkit.checkpoint``
``fabric``     ``ShardkitFabricStrategy``: the same for ``fabric.save``/``load``
``store``      where checkpoints go: one per path, or managed steps behind
               pointer files (``keep_last``, ``dedup``, the ``local=`` hot tier);
               also reads Lightning's own DCP folders
``state``      Lightning's checkpoint dict split into sharded tensors and the
               loop's state as JSON (no pickle)
``sizes``      what ``"auto"`` data- and tensor-parallel sizes resolve to (FSDP
               over every process by default)
=============  ================================================================

Importing this package imports Lightning; without it,
:class:`~shardkit.errors.IntegrationUnavailable` says ``pip install 'shardkit[lightning]'``.
"""

from shardkit.integrations.lightning.fabric import ShardkitFabricStrategy
from shardkit.integrations.lightning.strategy import ShardkitStrategy

__all__ = ["ShardkitStrategy", "ShardkitFabricStrategy"]
