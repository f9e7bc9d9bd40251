"""A torchrun job for tests/integrations/test_torchtitan.py: a save killed half way, then the resume.

``argv``: the run's folder, the phase, the file the losses go to (JSON, rank 0).

* ``full``: 6 steps, never stopped (the losses to match).
* ``crash``: steps 1-5 save steps 2 and 4; at step 6 rank 1 writes its data file of ``step-6`` and is
  killed (SIGKILL) before the step commits -- torchrun then stops rank 0: ``step-6`` holds data, no commit.
* ``resume``: a new job on the same folder: it must resume step 4 and train 5 and 6.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from shardkit.checkpoint.io.storage import Storage  # noqa: E402
from tests.support.torchtitan_ranks import shardkit_config  # noqa: E402
from tests.support.torchtitan_seam import STEPS, Run  # noqa: E402


def _die_after_writing_step_6() -> None:
    """Rank 1 dies right after its first data file of step-6 is on disk (before any commit)."""
    write_stream = Storage.write_stream

    def then_die(self, name, produce, **options):
        written = write_stream(self, name, produce, **options)
        if dist.get_rank() == 1 and self.url.rstrip("/").endswith("step-6"):
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    Storage.write_stream = then_die


def main() -> None:
    root, phase, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    run = Run(shardkit_config(), os.path.join(root, phase if phase == "full" else "run"))
    if phase == "crash":
        run.train(5)
        _die_after_writing_step_6()
        run.train(STEPS, load=False)  # rank 1 dies in step 6's save; torchrun stops rank 0
        raise SystemExit(f"rank {dist.get_rank()} survived the crash it was meant to die in")
    losses = run.train(STEPS)
    result = {"restored_from": STEPS - len(losses), "losses": losses}
    run.close()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
