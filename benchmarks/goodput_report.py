"""The report of ``benchmarks/goodput.py`` (its docstring says what each figure is and why): the judged table of
the paired blocks, the whole runs' table and per-step figures beside it when measured, and the verdicts."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

import checkpoint_targets as targets  # beside this file (goodput.py puts benchmarks/ on sys.path)
from goodput_saver import ARMS

DCP_LIMIT, TC_LIMIT = 0.5, 1.0
STEPS_AFTER, QUIET = 4, 5  # per-step figures: the steps a save is charged with, the quiet steps before it
JUDGED = "paired blocks"


def block_overhead(blocks: dict[str, Any]) -> float:
    """One round's overhead from its paired blocks: (sum of arm blocks - sum of baseline blocks) / the latter."""
    return sum(blocks["arm"]) / sum(blocks["base"]) - 1


def block_standard_error(rounds: list[dict[str, Any]], arm: str) -> float:
    """One standard error of the overhead, from the spread of the paired differences (arm block - its baseline
    block) over every block of every round, over the mean baseline block: how far the noise left moves it."""
    diffs = [a - b for r in rounds for a, b in zip(r[arm]["blocks"]["arm"], r[arm]["blocks"]["base"])]
    base = statistics.mean(b for r in rounds for b in r[arm]["blocks"]["base"])
    return statistics.stdev(diffs) / math.sqrt(len(diffs)) / base if len(diffs) > 1 else float("nan")


def lost_per_failure(interval_steps: int, step_s: float, lag: float, resume: float, overhead: float,
                     base_step_s: float, fail_every: int) -> tuple[float, float]:
    """(work a failure at a random moment redoes -- half the interval between saves plus the lag from a save's
    start to its commit --, and that plus the resume plus the overhead paid over ``fail_every`` steps (a
    negative overhead counted 0: noise))."""
    lost = interval_steps * step_s / 2 + lag
    return lost, max(0.0, overhead) * base_step_s * fail_every + lost + resume


def report(size: str, res: dict[str, Any], args: argparse.Namespace) -> list[targets.Verdict]:
    rounds = res["rounds"]
    print(f"\n{size}: {res['state_bytes'] / 1e6:.1f} MB of state (Transformer {res['model']}), {args.ranks} ranks, "
          f"{args.steps} steps per arm, {len(rounds)} rounds, medians over the rounds")
    overhead = print_blocks(rounds, args)
    whole = None
    if all("run" in r[arm] for r in rounds for arm in ARMS):
        whole = print_whole_runs(rounds, args)
        print_step_figures(rounds, args)
    return verdicts(size, rounds, overhead, whole, args)


def print_blocks(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, float]:
    """The judged table: per arm, its blocks and its baseline's summed (median over the rounds), the overhead
    (median over the rounds of the per-round overhead) with one standard error, the cost per block (mean over
    the blocks; the median of the paired differences beside it), the closing wait (mean over the blocks),
    the lag, the resume and the
    work lost per failure; returns the overheads."""
    blocks = args.steps // args.every
    print(f"  JUDGED: paired blocks -- {blocks} blocks of {args.every} steps per arm, each opening with its save and "
          f"closing with the wait for its commit, each paired with {args.every} steps without saves on the same "
          f"model right before or after it (alternating); overhead = (sum of arm blocks - sum of baseline "
          f"blocks) / sum of baseline blocks")
    print(f"  {'arm':26s} {'arm s':>7s} {'base s':>7s} {'overhead':>9s} {'+-1 se':>7s} {'ms/block':>8s} "
          f"{'median ms':>9s} {'wait ms':>7s} {'saves':>5s} {'lag s':>6s} {'resume s':>8s} {'lost/failure s':>14s} "
          f"{'lost per ' + str(args.fail_every) + ' steps s':>20s}  resumes bitwise")
    overhead = {}
    for arm in ARMS:
        rows = [r[arm]["blocks"] for r in rounds]

        def med(key: str, of: Any = None, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median((of or (lambda v: v))(row[key]) for row in rows)

        overhead[arm] = statistics.median(block_overhead(row) for row in rows)
        arm_s, base_s = med("arm", sum), med("base", sum)
        per_block = statistics.median((sum(row["arm"]) - sum(row["base"])) / len(row["arm"]) for row in rows)
        paired = statistics.median(a - b for row in rows for a, b in zip(row["arm"], row["base"]))
        lost, per_period = lost_per_failure(1 if arm == "shardkit-hot" else args.every, arm_s / args.steps,
                                            med("lag"), med("resume"), overhead[arm], base_s / args.steps,
                                            args.fail_every)
        print(f"  {arm:26s} {arm_s:7.2f} {base_s:7.2f} {100 * overhead[arm]:8.1f}% "
              f"{100 * block_standard_error(rounds, arm):6.1f}% {1000 * per_block:8.1f} {1000 * paired:9.1f} "
              f"{1000 * med('wait', statistics.mean):7.1f} {rows[0]['saves']:5d} {med('lag'):6.3f} "
              f"{med('resume'):8.3f} {lost:14.3f} {per_period:20.3f}  all {len(rounds)}")
    return overhead


def print_whole_runs(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, float]:
    """The earlier measure, not judged: each arm's whole run against its baseline's whole run beside it
    (overhead: the median over the rounds of wall / the baseline's wall - 1); returns the overheads."""
    print(f"  (not judged) whole runs: {args.steps} steps in one run per arm and per baseline beside it, the wait "
          f"for the last save on the clock; overhead: the median over the rounds of (wall / its paired "
          f"baseline's wall - 1)")
    print(f"  {'arm':26s} {'wall s':>7s} {'base s':>7s} {'overhead':>9s} {'saves':>5s} {'lag s':>6s} {'resume s':>8s} "
          f"{'lost/failure s':>14s} {'lost per ' + str(args.fail_every) + ' steps s':>20s}  resumes bitwise")
    overhead = {}
    for arm in ARMS:
        def med(key: str, arm: str = arm) -> float:
            return statistics.median(r[arm]["run"][key] for r in rounds)

        wall, base = med("wall"), med("baseline")
        overhead[arm] = statistics.median(r[arm]["run"]["wall"] / r[arm]["run"]["baseline"] - 1 for r in rounds)
        lost, per_period = lost_per_failure(1 if arm == "shardkit-hot" else args.every, wall / args.steps,
                                            med("lag"), med("resume"), overhead[arm], base / args.steps,
                                            args.fail_every)
        print(f"  {arm:26s} {wall:7.2f} {base:7.2f} {100 * overhead[arm]:8.1f}% {rounds[0][arm]['run']['saves']:5d} "
              f"{med('lag'):6.3f} {med('resume'):8.3f} {lost:14.3f} {per_period:20.3f}  all {len(rounds)}")
    return overhead


def lost_per_save(steps: list[float], every: int, after: int = STEPS_AFTER) -> tuple[list[float], float]:
    """The step time a save costs, read from one whole run's step times (max over the ranks): for each save at
    step ``s`` but the last, the excess of steps ``s .. s+after-1`` (the save's blocking call and the steps its
    background work overlaps) over the median of the ``QUIET`` steps before ``s`` (the last save's work is long
    done by then); and that quiet median."""
    quiet_all, lost = [], []
    for s in range(every, len(steps) + 1 - after, every):
        quiet = statistics.median(steps[max(0, s - 1 - QUIET):s - 1])
        quiet_all.append(quiet)
        lost.append(sum(t - quiet for t in steps[s - 1:s - 1 + after]))
    return lost, statistics.median(quiet_all) if quiet_all else statistics.median(steps)


def print_step_figures(rounds: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Per-step figures of the whole runs of the arms that save every ``--every`` steps, and of their
    baselines at the same steps (the noise floor): the step time lost per save (median over the saves and
    rounds), the wait for the last save after the last step, and an overhead rebuilt from them -- (lost per
    save x saves + the last save's step excess + that wait) / (quiet step x steps)."""
    print(f"  (not judged) per step of the whole runs (max over ranks): lost per save = steps s..s+{STEPS_AFTER - 1} "
          f"of each save at s over the median of the {QUIET} steps before s (median over saves and rounds); "
          f"baseline: the same steps of the paired run without saves")
    print(f"  {'arm':26s} {'lost/save ms':>12s} {'baseline ms':>11s} {'last wait ms':>12s} {'quiet step ms':>13s} "
          f"{'overhead from steps':>19s}")
    from_steps = {}
    for arm in ARMS:
        if arm == "shardkit-hot":
            continue
        lost, floor, est = [], [], []
        for r in rounds:
            run = r[arm]["run"]
            mine, quiet = lost_per_save(run["steps"], args.every)
            lost += mine
            floor += lost_per_save(run["base_steps"], args.every)[0]
            last = run["steps"][-1] - quiet
            est.append((sum(mine) / len(mine) * (run["saves"] - 1) + last + run["tail"])
                       / (quiet * len(run["steps"])))
        print(f"  {arm:26s} {1000 * statistics.median(lost):12.1f} {1000 * statistics.median(floor):11.1f} "
              f"{1000 * statistics.median(r[arm]['run']['tail'] for r in rounds):12.1f} "
              f"{1000 * statistics.median(lost_per_save(r[arm]['run']['steps'], args.every)[1] for r in rounds):13.1f} "
              f"{100 * statistics.median(est):18.1f}%")
        from_steps[arm] = statistics.median(est)
    for peer in ("dcp-async", "torch_checkpointing-async"):
        if "shardkit-async" in from_steps and from_steps.get(peer, 0) > 0:
            print(f"  (not judged) overhead from steps, shardkit-async / {peer}'s: "
                  f"{from_steps['shardkit-async'] / from_steps[peer]:.2f}x")


def verdicts(size: str, rounds: list[dict[str, Any]], overhead: dict[str, float], whole: dict[str, float] | None,
             args: argparse.Namespace) -> list[targets.Verdict]:
    """The targets on the paired blocks' overheads (shardkit-async judged, each overhead with one standard
    error; the hot tier's ratios printed, not a target), the whole runs' ratios printed beside them when
    measured."""
    found = []
    shown = {arm: f"{100 * overhead[arm]:.1f}% +-{100 * block_standard_error(rounds, arm):.1f}" for arm in ARMS}
    for peer, limit in (("dcp-async", DCP_LIMIT), ("torch_checkpointing-async", TC_LIMIT)):
        for arm in ("shardkit-async", "shardkit-hot"):
            name = f"{size} overhead {arm} / {peer}'s ({JUDGED})"
            if overhead[peer] <= 0:
                print(f"  {name}: not judged, {peer}'s overhead {100 * overhead[peer]:.1f}% is within noise")
                if arm == "shardkit-async":
                    found.append(targets.Verdict(name, None, limit, not_measured="the peer's overhead <= 0"))
                continue
            ratio = overhead[arm] / overhead[peer]
            detail = f"{shown[arm]} / {shown[peer]}"
            if arm == "shardkit-async":
                found.append(targets.Verdict(name, max(ratio, 0.0), limit, detail))
            else:
                print(f"  (not a target) {name}: {ratio:.2f}x ({detail}; hot every step vs durable every "
                      f"{args.every})")
    for peer in ("dcp-async", "torch_checkpointing-async") if whole is not None else ():
        ratio_text = (f"{whole['shardkit-async'] / whole[peer]:.2f}x" if whole[peer] > 0
                      else f"not a ratio, {peer}'s {100 * whole[peer]:.1f}%")
        print(f"  (not judged) whole runs, shardkit-async / {peer}'s: {ratio_text} "
              f"({100 * whole['shardkit-async']:.1f}% / {100 * whole[peer]:.1f}%)")
    return found
