"""The finer-plan scheduler of this tree against another tree's, interleaved call by call.

This shared machine's timings swing by up to 2x from one process to the next, more than a
scheduler change moves them; timed in one process, the two alternating on the same inputs, they
see the same machine. Each call schedules one input (``choices.choice_plan_checked`` with the
timeline of that input's prediction, as a Mimose miss does, the prediction margin included) on:
the stacks ``planner_latency.py`` plans (tiny BERTs of 12 and 48 blocks, fitted from the probes,
budget 0.6 x none's peak) and random 48-block stacks in a shuffled forward order whose budgets
fall halfway between every block recomputed and none (a harder case: more plans predicted).
How many stacks the two planned alike is in the table: where they differ, the timing compares
different work. Writes benchmarks/results/scheduler_ab.json.

    git worktree add /tmp/old <revision>
    python benchmarks/scheduler_ab.py --old /tmp/old [--repeat 400] [--stacks 40]
"""

import argparse
import importlib.util
import inspect
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from planner_latency import SIZE, fitted_planner

from mimose_cli.planners.mimose.estimator import BLOCK_QUANTITIES, STEP_QUANTITIES, Prediction
from mimose_cli.planners.mimose import choices, estimator

from _results import write_results

MARGIN = 1.001  # Mimose's default prediction margin, on every predicted peak


def load(tree: Path, module: str):
    """``mimose_cli/planners/<module>.py`` of another tree, loaded beside this tree's modules."""
    path = tree / "mimose_cli" / "planners" / f"{module}.py"
    if not path.is_file():
        raise SystemExit(f"--old {tree}: no {path.relative_to(tree)} there; give a checkout of mimose")
    spec = importlib.util.spec_from_file_location(f"old_{module}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def scheduler(choices_module, estimator_module):
    """``schedule(pred, savings, costs, limit, counter) -> plan`` for a tree: its scheduler given
    a peak per plan (trees before ``estimator.Timeline``) or per batch of plans (since)."""
    batched = "predict_peaks" in inspect.signature(choices_module.choice_plan_checked).parameters

    def schedule(pred, savings, costs, limit, counter):
        if batched:
            timeline = estimator_module.Timeline(pred)

            def predict(levels):
                counter[0] += 1
                return timeline.level_peaks(levels) * MARGIN
        else:
            def predict(plan, selective):
                counter[0] += 1
                return estimator_module.plan_peak_bytes(pred, plan, selective) * MARGIN
        return choices_module.choice_plan_checked(savings, costs, predict, limit)

    return schedule


def planner_case(num_blocks: int) -> tuple:
    """What a miss at ``SIZE`` schedules for ``planner_latency.py``'s stack."""
    planner = fitted_planner(num_blocks, "selective")
    policy = planner.policy
    pred = policy.estimator.predict(SIZE)
    limit = 0.6 * estimator.plan_peak_bytes(pred, ())
    recompute_ms, selective_ms = policy.choice_times.at(policy.estimator.feature_set.of(SIZE))
    planner.close()
    return pred, *_choices(pred, selective_ms, recompute_ms), limit


def random_case(rng: random.Random, n: int) -> tuple:
    """A made-up stack: integer bytes (plain above checkpointed, peaks around them), a shuffled
    forward order, selective cheaper than recompute by 0-5 ms."""
    plain = np.array([rng.randint(20, 100) for _ in range(n)], dtype=float)
    blocks = {q: np.array([rng.randint(0, 40) for _ in range(n)], dtype=float) for q in BLOCK_QUANTITIES}
    blocks.update(plain_bytes=plain, ckpt_bytes=np.array([rng.randint(1, 10) for _ in range(n)], dtype=float))
    blocks["fwd_peak_bytes"] = plain + blocks["fwd_peak_bytes"]
    blocks["recompute_peak_bytes"] = plain + blocks["recompute_peak_bytes"]
    pred = Prediction((1, 1), blocks, {q: float(rng.randint(0, 30)) for q in STEP_QUANTITIES},
                      tuple(rng.sample(range(n), n)))
    recompute_ms = np.array([float(rng.randint(1, 8)) for _ in range(n)])
    selective_ms = recompute_ms - np.array([float(rng.randint(0, 5)) for _ in range(n)])
    low, high = estimator.plan_peak_bytes(pred, range(n)), estimator.plan_peak_bytes(pred, ())
    return pred, *_choices(pred, selective_ms, recompute_ms), low + 0.5 * (high - low)


def _choices(pred, selective_ms, recompute_ms) -> tuple:
    """``(savings, costs)`` per level, as Mimose builds them (selective only where it frees bytes)."""
    n = len(recompute_ms)
    selective = pred.savings - np.maximum(pred.blocks["selective_extra_bytes"], 0.0)
    return ([np.zeros(n), np.where(selective > 0, selective, np.nan), pred.savings],
            [np.zeros(n), selective_ms, recompute_ms])


def compare(label: str, cases: list, schedulers: dict, repeat: int) -> dict:
    """Median µs per call and plans predicted per call for each tree, alternating which goes first."""
    plans = {who: [schedule(*case, [0])[:2] for case in cases] for who, schedule in schedulers.items()}
    same = sum(a == b for a, b in zip(*plans.values()))
    times = {who: [] for who in schedulers}
    calls = {who: [0] for who in schedulers}
    order = list(schedulers.items())
    for r in range(repeat):
        for case in cases:
            for who, schedule in order if r % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                schedule(*case, calls[who])
                times[who].append(time.perf_counter() - start)
    row = {"stacks": label, "cases": len(cases), "same_plans": same}
    for who in schedulers:
        row[f"{who}_us"] = statistics.median(times[who]) * 1e6
        row[f"{who}_predictions"] = calls[who][0] / (repeat * len(cases))
    row["new_over_old"] = row["new_us"] / row["old_us"]
    print(f"{label:>28} {row['old_us']:8.0f} {row['old_predictions']:8.1f} {row['new_us']:8.0f} "
          f"{row['new_predictions']:8.1f} {row['new_over_old']:8.2f} {same:>4}/{len(cases)}", flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, type=Path, help="a checkout of the revision to compare with")
    parser.add_argument("--repeat", type=int, default=400, help="calls per planner_latency stack and tree")
    parser.add_argument("--stacks", type=int, default=40, help="random 48-block stacks (each called repeat/40 times)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    schedulers = {"old": scheduler(load(args.old, "choices"), load(args.old, "estimator")),
                  "new": scheduler(choices, estimator)}
    print(f"{'stacks':>28} {'old us':>8} {'old pred':>8} {'new us':>8} {'new pred':>8} {'new/old':>8} same")
    rows = [compare(f"planner_latency {n} blocks", [planner_case(n)], schedulers, args.repeat) for n in (12, 48)]
    rng = random.Random(0)
    rows.append(compare(f"{args.stacks} random 48-block", [random_case(rng, 48) for _ in range(args.stacks)],
                        schedulers, max(1, args.repeat // 40)))
    differ = sum(row["cases"] - row["same_plans"] for row in rows)
    if differ:
        print(f"the trees chose different plans on {differ} stacks: there the timing compares different work "
              "(a scheduler that plans differently predicts other plans)")
    write_results("scheduler_ab", rows, old=str(args.old))


if __name__ == "__main__":
    main()
