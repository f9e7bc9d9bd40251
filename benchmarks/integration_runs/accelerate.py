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

import json
import os
import subprocess
import sys
import tempfile
import time

ENGINES = ("default", "shardkit")
RUN_TIMEOUT_S = 600


def measure(engine: str, workdir: str) -> dict:
    """The slowest rank's ``save_state`` and ``load_state`` seconds with ``engine`` on 2 gloo ranks."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: use one of {ENGINES}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.abspath(__file__), engine, workdir]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"accelerate {engine} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    with open(os.path.join(workdir, "result.json")) as f:
        return json.load(f)


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

    def timed(call) -> float:
        dist.barrier()
        start = time.perf_counter()
        call()
        took = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return took.item()

    use_shardkit(engine == "shardkit")
    acc.save_state(os.path.join(workdir, "warm"))
    save_s = timed(lambda: acc.save_state(os.path.join(workdir, "ckpt")))
    resume_s = timed(lambda: acc.load_state(os.path.join(workdir, "ckpt")))
    if dist.get_rank() == 0:
        with open(os.path.join(workdir, "result.json"), "w") as f:
            json.dump({"save_s": save_s, "resume_s": resume_s}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # run as a script, this file's folder comes first on sys.path, and this file would shadow the package
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    if len(sys.argv) == 3:
        _rank(sys.argv[1], sys.argv[2])
    else:
        for name in ENGINES:
            with tempfile.TemporaryDirectory(prefix=f"accelerate-{name}-") as where:
                print(name, measure(name, where))
