"""Accelerate's ``save_state`` / ``load_state`` on FSDP2: its own DCP engine vs ``use_shardkit()``.

``measure(engine, workdir)`` launches 2 gloo ranks under torchrun running
this file.  Each rank builds the same Llama (about 4.4 M parameters: with
AdamW's two moments about 53 MB of state), prepared by an Accelerator
switched to FSDP2 with ``SHARDED_STATE_DICT`` (Accelerate selects FSDP only
on an accelerator: ``accelerate/state.py``, ``AcceleratorState.__init__``),
trains one step so the optimizer has its state, and then, with engine
``default`` (Accelerate's DCP) or ``shardkit`` (``use_shardkit()``):

* saves once into ``workdir/warm`` (what a job's first save pays once, for
  either engine: thread pools, process groups, plans),
* times ``accelerator.save_state(workdir/ckpt)``,
* times ``accelerator.load_state(workdir/ckpt)`` into the live model and optimizer.

Each time is the slowest rank's (a barrier before, an all-reduce of the
maxima after).  Returns ``{"save_s": ..., "resume_s": ...}``.

    python benchmarks/integration_runs/accelerate.py   # one measurement of each engine
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.integration_launch import launch, run_as_script, slowest_rank_seconds, write_result  # noqa: E402


def measure(engine: str, workdir: str) -> dict:
    """The slowest rank's ``save_state`` and ``load_state`` seconds with ``engine`` on 2 gloo ranks."""
    return launch(__file__, "Accelerate", engine, workdir)


def _rank(engine: str, workdir: str) -> None:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit.integrations.accelerate import use_shardkit

    torch.set_num_threads(1)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    acc.state.distributed_type = DistributedType.FSDP  # Accelerate never selects FSDP on a CPU host
    acc.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4000, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()

    use_shardkit(engine == "shardkit")
    acc.save_state(os.path.join(workdir, "warm"))
    save_s = slowest_rank_seconds(lambda: acc.save_state(os.path.join(workdir, "ckpt")))
    resume_s = slowest_rank_seconds(lambda: acc.load_state(os.path.join(workdir, "ckpt")))
    write_result(workdir, {"save_s": save_s, "resume_s": resume_s})


if __name__ == "__main__":
    run_as_script(__file__, _rank, measure)
