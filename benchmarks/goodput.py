"""Goodput: the training time each checkpointing system costs, and the work a failure loses.

One ``--ranks``-rank ``torchrun`` job (gloo, CPU; 2 by default) trains a small Transformer
(``tests/support/models.py``; AdamW; its size from ``--sizes``: weights + two moments) for ``--steps`` steps
per arm, ``--rounds`` times, the arms in an order that rotates from round to round. The model is held twice:
under ``shardkit.fully_shard`` for the shardkit arms and the shardkit baseline, under torch's ``fully_shard``
for DCP, torch_checkpointing and the torch baseline (:mod:`peers_systems` configures the systems and says
why). Arms:

* ``none/shardkit``, ``none/torch``: no checkpoint (each runtime's baseline), run next to every arm of
  that runtime (before it in even rounds, after it in odd ones), so each arm has a baseline measured
  in the same minute: this machine's load drifts;
* ``shardkit-async``: ``shardkit.checkpoint.async_save`` every ``--every`` steps;
* ``shardkit-hot``: ``CheckpointManager(async_save=True, local=/dev/shm/..., local_world_size=1,
  replicas=1, durable_every=--every)`` -- ``save`` every step: the hot tier (node-local copy + a replica
  on the other rank, playing the other node) every step, durable every ``--every``;
* ``dcp-async``: ``dcp.async_save`` (its thread) every ``--every`` steps;
* ``torch_checkpointing-async``: its async ``CheckpointManager`` every ``--every`` steps, ``optimizer.step()``
  inside ``manager.lock()`` as its docs ask (its staging overlaps the next forward and backward).

Each arm first saves once, untimed (step 0), so writer processes exist and staging buffers are allocated:
the steady state of a long run (torch_checkpointing's first async save spawns its writer: seconds).
Every save is handed the state dict taken at that step (``get_training_state`` / ``get_state_dict``); a save
starts only after the previous one of the arm committed (waited for where it is still running, on the
clock), and the arm's wall time includes the wait for its last save.  The overhead of an arm is (wall time
- its paired baseline) / that baseline, the median over the rounds.  After each arm, untimed for goodput but
timed as "resume": the state is snapshotted, zeroed, loaded back from the arm's last checkpoint (the last
step is always a save) with the system's own load, and compared bitwise with the snapshot.

Work lost per failure, one failure every ``--fail-every`` steps: a failure at a random moment redoes on
average half the interval between saves plus the lag from a save's start to its commit (measured, median),
then pays the resume (measured); per ``--fail-every`` steps the arm also pays its overhead (taken as 0 where
the measured one is negative: noise).  Each runtime first trains 12 steps, untimed, before any arm.

Per step, too: every step's time (the save it starts included; the max over the ranks) is kept, and for the
arms that save every ``--every`` steps the report gives the step time each save costs -- the excess of the
save's step and the 3 after it over the median of the 5 steps before it (median over saves and rounds), the
same steps of the paired baseline beside it (the noise floor) -- the wait for the last save, and an overhead
rebuilt from those.  Where other jobs share the machine, the wall-time overhead is the difference of two runs
seconds apart; the per-step figure compares steps of one run a second apart.

Targets: the overhead of ``shardkit-async`` <= 0.5x ``dcp-async``'s and <= 1.0x torch_checkpointing's.

    python benchmarks/goodput.py                               # 50MB of state, 60 steps, 5 rounds
    python benchmarks/goodput.py --sizes 5MB --rounds 1        # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import checkpoint_targets as targets  # noqa: E402 - beside this file
import peers_systems as ps  # noqa: E402

ARMS = ("shardkit-async", "shardkit-hot", "dcp-async", "torch_checkpointing-async")  # each paired with its baseline
RUNTIME = {"none/shardkit": "shardkit", "shardkit-async": "shardkit", "shardkit-hot": "shardkit"}
SYSTEM = {"shardkit-async": "shardkit", "shardkit-hot": "shardkit", "dcp-async": "dcp",
          "torch_checkpointing-async": "torch_checkpointing"}
DCP_LIMIT, TC_LIMIT = 0.5, 1.0
STEPS_AFTER, QUIET = 4, 5  # per-step figures: the steps a save is charged with, the quiet steps before it


def model_args(nbytes: float) -> Any:
    """A Transformer whose weights + AdamW moments (12 bytes a parameter) come near ``nbytes``."""
    from tests.support.models import ModelArgs

    dim = 64 if nbytes < 20e6 else 256 if nbytes < 200e6 else 512
    vocab, ffn = 16 * dim, 3 * dim
    layers = max(1, round((nbytes / 12 - 2 * vocab * dim) / (4 * dim * dim + 3 * dim * ffn)))
    return ModelArgs(vocab_size=vocab, dim=dim, n_heads=4, n_layers=layers, ffn_dim=ffn, max_seq_len=64)


def build(margs: Any, runtime: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from tests.support.models import Transformer

    if runtime == "shardkit":
        from shardkit import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Transformer(margs)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# -- one arm -----------------------------------------------------------------------------------------------------


class Saver:
    """One arm's saves: ``start(step)`` begins a save of the state at ``step`` (after the previous committed);
    ``lock()`` guards the optimizer step; ``finish()`` waits for the last; ``resume()`` loads it back."""

    def __init__(self, arm: str, model: Any, opt: Any, root: str, shm: str, every: int, group: Any) -> None:
        self.arm, self.model, self.opt, self.root, self.every, self.group = arm, model, opt, root, every, group
        self.future: Any = None
        self.lags: list[float] = []
        self.saves = 0
        self.last = ""
        self.hot_args = dict(keep_last=2, async_save=True, local=os.path.join(shm, "node{node}"),
                             local_world_size=1, replicas=1, local_keep=2, durable_every=every)
        self.hot = self.tc = None
        if arm == "shardkit-hot":
            import shardkit.checkpoint as skc

            self.hot = skc.CheckpointManager(root, **self.hot_args)
        elif arm == "torch_checkpointing-async":
            self.tc = ps.tc_manager(async_save=True)

    def state(self) -> dict[str, Any]:
        return ps.state_of(SYSTEM[self.arm], self.model, self.opt)

    def due(self, step: int) -> bool:
        return self.arm == "shardkit-hot" or (self.arm in SYSTEM and step % self.every == 0)

    def start(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        import shardkit.checkpoint as skc

        if self.future is not None:
            self.future.result()
        self.last = os.path.join(self.root, f"step-{step}")
        started = time.perf_counter()
        if self.arm == "shardkit-hot":
            future = self.hot.save(step, self.model, self.opt)
        elif self.arm == "shardkit-async":
            future = skc.async_save(self.state(), self.last, process_group=self.group)
        elif self.arm == "dcp-async":
            future = dcp.async_save(self.state(), checkpoint_id=self.last, process_group=self.group)
        else:
            future = self.tc.save(self.last, self.state())
        self.future = future
        future.add_done_callback(lambda _: self.lags.append(time.perf_counter() - started))

    def lock(self) -> Any:
        return self.tc.lock() if self.tc is not None else contextlib.nullcontext()

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
        if self.hot is not None:
            self.hot.wait()
        while len(self.lags) < self.saves:  # the callbacks run on the saver's thread just after done()
            time.sleep(0.001)

    def resume(self, final_step: int) -> None:
        """Load the last checkpoint back into the (zeroed) model and optimizer with the system's own load."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        import shardkit.checkpoint as skc

        if self.arm == "shardkit-hot":
            manager = skc.CheckpointManager(self.root, **self.hot_args)
            manager.load_latest(self.model, self.opt, required=True)
            if manager.last_load.step != final_step:
                raise SystemExit(f"{self.arm}: resumed step {manager.last_load.step}, want {final_step}")
            return
        state = self.state()
        if self.arm == "shardkit-async":
            skc.load(state, self.last)
            skc.set_training_state(self.model, self.opt, state)
            return
        if self.arm == "dcp-async":
            dcp.load(state, checkpoint_id=self.last)
        else:
            manager = ps.tc_manager(async_save=False)
            state = dict(manager.load(self.last, into=state))
            manager.close()
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def close(self) -> None:
        if self.tc is not None:
            self.tc.close()


def train_step(model: Any, opt: Any, tokens: torch.Tensor, lock: Any) -> None:
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    with lock:
        opt.step()
    opt.zero_grad(set_to_none=True)


def batches_for(model: Any, batch: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    vocab = model.tok_embeddings.weight.shape[0]
    return [torch.randint(0, vocab, (batch, 65), generator=gen) for _ in range(4)]


def run_arm(arm: str, model: Any, opt: Any, args: argparse.Namespace, work: str, group: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    root = os.path.join(work, arm.replace("/", "-"))
    shm = os.path.join(args.shm, arm.replace("/", "-"))
    saver = Saver(arm, model, opt, root, shm, args.every, group)
    if arm in SYSTEM:  # a first save, untimed: writer processes up, staging buffers allocated (a long run's state)
        saver.saves = 1
        saver.start(0)
        saver.finish()
        saver.saves, saver.lags = 0, []
    batches = batches_for(model, args.batch)
    dist.barrier()
    started = time.perf_counter()
    steps = []  # each step's time, the save it starts included
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        train_step(model, opt, batches[step % len(batches)], saver.lock())
        if saver.due(step):
            saver.saves += 1
            saver.start(step)
        steps.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    saver.finish()
    tail = time.perf_counter() - t0
    wall = time.perf_counter() - started
    out: dict[str, Any] = {"wall": wall, "saves": saver.saves, "tail": tail, "steps": max_over_ranks(steps)}
    if arm in SYSTEM:
        lag = statistics.median(saver.lags)
        snapshot = {k: ps.local(t).clone() for k, t in ps.tensors(saver.state()).items()}
        for t in ps.tensors(saver.state()).values():
            ps.local(t).zero_()
        dist.barrier()
        t0 = time.perf_counter()
        saver.resume(args.steps)
        out["resume"] = time.perf_counter() - t0
        after = {k: ps.local(t) for k, t in ps.tensors(saver.state()).items()}
        bad = [k for k, t in snapshot.items() if k not in after or not torch.equal(t, after[k])]
        if bad:
            raise SystemExit(f"{arm}: the resumed state differs from the saved one, e.g. {bad[:3]}")
        out["lag"] = lag
    saver.close()
    keys = ("wall", "resume", "lag", "tail")
    maxed = max_over_ranks([out.get(k, 0.0) for k in keys])
    out.update({k: v for k, v in zip(keys, maxed) if k in out})
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    dist.barrier()
    return out


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ps.install_torch_checkpointing_cpu()
    group = dist.new_group(backend="gloo")
    margs = model_args(args.size)
    models = {rt: build(margs, rt) for rt in ("shardkit", "torch")}
    for model, opt in models.values():  # untimed: each runtime's first steps (lazy set-up) before any arm
        for tokens in batches_for(model, args.batch) * 3:
            train_step(model, opt, tokens, contextlib.nullcontext())
    nbytes = sum(ps.local(t).numel() * 4 for t in models["shardkit"][0].parameters()) * 3 * dist.get_world_size()
    rounds = []
    for r in range(args.rounds):
        row = {}
        for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
            baseline = f"none/{RUNTIME.get(arm, 'torch')}"
            for one in (baseline, arm) if r % 2 == 0 else (arm, baseline):
                row[one] = run_arm(one, *models[RUNTIME.get(arm, "torch")], args, args.dir, group)
            paired = row.pop(baseline)
            row[arm]["baseline"], row[arm]["base_steps"] = paired["wall"], paired["steps"]
        rounds.append(row)
        if dist.get_rank() == 0:
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, "result.json"), "w") as f:
            json.dump({"rounds": rounds, "state_bytes": nbytes, "model": vars(margs) if hasattr(margs, "__dict__")
                       else str(margs)}, f, default=str)
    dist.barrier()
    dist.destroy_process_group()


# -- the driver and the report -------------------------------------------------------------------------------------


def report(size: str, res: dict[str, Any], args: argparse.Namespace) -> list[targets.Verdict]:
    rounds = res["rounds"]

    def med(arm: str, key: str) -> float:
        return statistics.median(r[arm][key] for r in rounds)

    print(f"\n{size}: {res['state_bytes'] / 1e6:.1f} MB of state (Transformer {res['model']}), {args.ranks} ranks, "
          f"{args.steps} steps per arm, {len(rounds)} rounds, medians; overhead: the median over the rounds of "
          f"(wall / its paired baseline's wall - 1)")
    print(f"  {'arm':28s} {'wall s':>7s} {'base s':>7s} {'overhead':>9s} {'saves':>5s} {'lag s':>6s} {'resume s':>8s} "
          f"{'lost/failure s':>14s} {'lost per ' + str(args.fail_every) + ' steps s':>20s}  resumes bitwise")
    overhead = {}
    for arm in ARMS:
        wall, base = med(arm, "wall"), med(arm, "baseline")
        overhead[arm] = statistics.median(r[arm]["wall"] / r[arm]["baseline"] - 1 for r in rounds)
        step_s = wall / args.steps
        interval = 1 if arm == "shardkit-hot" else args.every
        lost = interval * step_s / 2 + med(arm, "lag")
        per_period = max(0.0, overhead[arm]) * base / args.steps * args.fail_every + lost + med(arm, "resume")
        print(f"  {arm:28s} {wall:7.2f} {base:7.2f} {100 * overhead[arm]:8.1f}% {rounds[0][arm]['saves']:5d} "
              f"{med(arm, 'lag'):6.3f} {med(arm, 'resume'):8.3f} {lost:14.3f} {per_period:20.3f}  all {len(rounds)}")
    print_step_figures(rounds, args)
    verdicts = []
    for peer, limit in (("dcp-async", DCP_LIMIT), ("torch_checkpointing-async", TC_LIMIT)):
        for arm in ("shardkit-async", "shardkit-hot"):
            name = f"{size} overhead {arm} / {peer}'s"
            if overhead[peer] <= 0:
                print(f"  {name}: not judged, {peer}'s overhead {100 * overhead[peer]:.1f}% is within noise")
                if arm == "shardkit-async":
                    verdicts.append(targets.Verdict(name, None, limit, not_measured="the peer's overhead <= 0"))
                continue
            ratio = overhead[arm] / overhead[peer]
            detail = f"{100 * overhead[arm]:.1f}% / {100 * overhead[peer]:.1f}%"
            if arm == "shardkit-async":
                verdicts.append(targets.Verdict(name, max(ratio, 0.0), limit, detail))
            else:
                print(f"  (not a target) {name}: {ratio:.2f}x ({detail}; hot every step vs durable every "
                      f"{args.every})")
    return verdicts


def lost_per_save(steps: list[float], every: int, after: int = STEPS_AFTER) -> tuple[list[float], float]:
    """The step time a save costs, read from one arm's step times (max over the ranks): for each save at step
    ``s`` but the last, the excess of steps ``s .. s+after-1`` (the save's blocking call and the steps its
    background work overlaps) over the median of the ``QUIET`` steps before ``s`` (the last save's work is long
    done by then); and that quiet median.  A figure that load drifting over the arm's seconds hardly moves, as
    it moves every step alike, where the wall-time overhead takes the difference of two runs."""
    quiet_all, lost = [], []
    for s in range(every, len(steps) + 1 - after, every):
        quiet = statistics.median(steps[max(0, s - 1 - QUIET):s - 1])
        quiet_all.append(quiet)
        lost.append(sum(t - quiet for t in steps[s - 1:s - 1 + after]))
    return lost, statistics.median(quiet_all) if quiet_all else statistics.median(steps)


def print_step_figures(rounds: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Per-step figures of the arms that save every ``--every`` steps, and of their baselines at the same steps
    (the noise floor): the step time lost per save (median over the saves and rounds), the wait for the
    last save after the last step, and an overhead rebuilt from them -- (lost per save x saves + the last save's
    step excess + that wait) / (quiet step x steps)."""
    print(f"  per step (max over ranks): lost per save = steps s..s+{STEPS_AFTER - 1} of each save at s over the "
          f"median of the {QUIET} steps before s (median over saves and rounds); baseline: the same steps of the "
          f"paired run without saves")
    print(f"  {'arm':28s} {'lost/save ms':>12s} {'baseline ms':>11s} {'last wait ms':>12s} {'quiet step ms':>13s} "
          f"{'overhead from steps':>19s}")
    from_steps = {}
    for arm in ARMS:
        if arm == "shardkit-hot" or "steps" not in rounds[0][arm]:
            continue
        lost, floor, est = [], [], []
        for r in rounds:
            mine, quiet = lost_per_save(r[arm]["steps"], args.every)
            lost += mine
            floor += lost_per_save(r[arm]["base_steps"], args.every)[0]
            last = r[arm]["steps"][-1] - quiet
            est.append((sum(mine) / len(mine) * (r[arm]["saves"] - 1) + last + r[arm]["tail"])
                       / (quiet * len(r[arm]["steps"])))
        print(f"  {arm:28s} {1000 * statistics.median(lost):12.1f} {1000 * statistics.median(floor):11.1f} "
              f"{1000 * statistics.median(r[arm]['tail'] for r in rounds):12.1f} "
              f"{1000 * statistics.median(lost_per_save(r[arm]['steps'], args.every)[1] for r in rounds):13.1f} "
              f"{100 * statistics.median(est):18.1f}%")
        from_steps[arm] = statistics.median(est)
    for peer in ("dcp-async", "torch_checkpointing-async"):
        if "shardkit-async" in from_steps and from_steps.get(peer, 0) > 0:
            print(f"  (not a target) overhead from steps, shardkit-async / {peer}'s: "
                  f"{from_steps['shardkit-async'] / from_steps[peer]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="50MB", help="state sizes (weights + AdamW), comma-separated")
    parser.add_argument("--rounds", type=int, default=targets.MIN_ROUNDS)
    parser.add_argument("--ranks", type=int, default=2, choices=(2, 3, 4), help="ranks of the training job")
    parser.add_argument("--steps", type=int, default=60, help="training steps per arm (a multiple of --every)")
    parser.add_argument("--every", type=int, default=10, help="steps between (durable) saves")
    parser.add_argument("--batch", type=int, default=8, help="sequences of 64 tokens per rank and step")
    parser.add_argument("--fail-every", type=int, default=100, help="steps between failures (work lost)")
    parser.add_argument("--json", default=None, help="also keep the raw results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size-bytes", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--shm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps % args.every:
        parser.error("--steps must be a multiple of --every (the last step is a save: the resume checks it)")
    if args.worker:
        args.size = args.size_bytes
        worker(args)
        return
    print("configuration\n" + ps.CONFIGURATION)
    targets.judge_sizes(args.sizes, lambda size: one_size(args, size), lambda size, res: report(size, res, args),
                        args.rounds, args.json)


def one_size(args: argparse.Namespace, size: str) -> dict[str, Any]:
    """One size's results: the training runs under torchrun in a fresh work and shared-memory directory."""
    work = tempfile.mkdtemp(prefix="shardkit-goodput-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    shm = tempfile.mkdtemp(prefix="shardkit-goodput-", dir="/dev/shm")
    try:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={args.ranks}", os.path.abspath(__file__), "--worker",
                        "--size-bytes", str(ps.parse_size(size)),
                        "--dir", work, "--shm", shm, "--rounds", str(args.rounds), "--steps", str(args.steps),
                        "--every", str(args.every), "--batch", str(args.batch)],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(os.path.join(work, "result.json")) as f:
            return json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
