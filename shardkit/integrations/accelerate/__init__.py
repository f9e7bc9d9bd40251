"""shardkit as the checkpoint engine of Accelerate and the Hugging Face Trainer.

::

    from shardkit.integrations.accelerate import use_shardkit

    use_shardkit()   # from here on, FSDP2 save_state/load_state and the Trainer's checkpoint-N/ go through shardkit

With FSDP2 and ``SHARDED_STATE_DICT``, ``Accelerator.save_state`` and the
Trainer's ``_save_checkpoint`` write ``pytorch_model_fsdp_<i>/`` and
``optimizer_<i>/`` as shardkit checkpoints (checksummed, committed atomically,
loadable at any world size) beside Accelerate's own RNG, sampler, scheduler
and scaler files; ``load_state`` and ``resume_from_checkpoint`` read them,
and still read the DCP folders written before the switch.  The framework is
imported here: without it, :class:`~shardkit.errors.IntegrationUnavailable`
names ``pip install 'shardkit[accelerate]'``.
"""

from shardkit.integrations.requirements import import_framework

import_framework("accelerate", "accelerate")

from shardkit.integrations.accelerate.switch import ShardkitSwitch, is_on, use_shardkit  # noqa: E402

__all__ = ["use_shardkit", "ShardkitSwitch", "is_on"]
