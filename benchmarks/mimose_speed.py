"""Epoch time of Mimose against full checkpointing and no checkpointing, side by side.

A tiny BERT (12 layers) on SWAG-like and QQP-like lengths, one epoch through
`mimose_cli.launcher.train.run_training` with the same data order for every planner: `none` without a
budget (the speed limit), `full` and `mimose` at a budget where only the long batches need
checkpointing (calibrated as in mimose_safety.py; by default the 80th percentile of the
batches' no-checkpointing peaks, so the longest fifth must checkpoint). Mimose's time includes its
probes. The three runs are repeated in turn (--rounds) and each ratio is the median over rounds of
the per-round ratio, so load on a shared machine affects all three alike; Mimose's overhead (its
probes, fits and planning, in its mean iterations) is the median over rounds.
Targets: mimose <= 0.85x full and <= 1.10x none. Times are of the simulated device, whose
dispatch overhead per op inflates every planner alike.
Writes benchmarks/results/mimose_speed.json.

    python benchmarks/mimose_speed.py [--presets swag,qqp] [--steps 200] [--rounds 1]
"""

import argparse
import statistics
import tempfile

import torch
from mimose_safety import calibrate, recipe_for

from _results import run_training, write_results


def epoch_s(preset: str, steps: int, out_dir, planner: str, budget) -> tuple:
    overrides = [f"planner.name={planner}", f"budget={budget or 'null'}"]
    result = run_training(recipe_for(preset, steps, out_dir, *overrides), view="none",
                          recipe_name=f"speed-{preset}")
    return result.summary["train_time_s"], result.summary


def evaluate(preset: str, steps: int, rounds: int, quantile: float) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        budget = calibrate(preset, steps, out_dir, quantile)["budget_bytes"]
        times = {"none": [], "full": [], "mimose": []}
        overheads = []
        for _ in range(rounds):
            for planner in times:
                seconds, summary = epoch_s(preset, steps, out_dir, planner, None if planner == "none" else budget)
                times[planner].append(seconds)
                if planner == "mimose":
                    stats = summary["planner"]
                    blocks = summary["mean_checkpointed_blocks"]
                    overheads.append(stats.get("overhead_iterations") or 0.0)
    ratio_full = statistics.median(m / f for m, f in zip(times["mimose"], times["full"]))
    ratio_none = statistics.median(m / n for m, n in zip(times["mimose"], times["none"]))
    return {"preset": preset, "steps": steps, "budget_bytes": budget, "budget_quantile": quantile, "epoch_s": times,
            "mimose_over_full": ratio_full, "mimose_over_none": ratio_none,
            "mimose_mean_checkpointed_blocks": blocks, "num_blocks": stats.get("num_blocks"),
            "overhead_iterations": statistics.median(overheads), "overhead_iterations_per_round": overheads,
            "probe_skipped": stats.get("probe_skipped"), "hit_rate": stats.get("hit_rate"),
            "collector_ms": stats.get("collector_ms"), "estimator_fit_ms": stats.get("estimator_fit_ms"),
            "scheduler_ms_mean": stats.get("scheduler_ms_mean")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="swag,qqp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quantile", type=float, default=0.8,
                        help="budget = this quantile of the batches' no-checkpointing peaks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'preset':6} {'none s':>7} {'full s':>7} {'mimose s':>8} {'/full':>6} {'/none':>6} "
          f"{'ckpt blocks':>11} {'overhead it':>11}")
    for preset in args.presets.split(","):
        row = evaluate(preset, args.steps, args.rounds, args.quantile)
        rows.append(row)
        t = {k: statistics.median(v) for k, v in row["epoch_s"].items()}
        print(f"{preset:6} {t['none']:7.1f} {t['full']:7.1f} {t['mimose']:8.1f} {row['mimose_over_full']:6.3f} "
              f"{row['mimose_over_none']:6.3f} {row['mimose_mean_checkpointed_blocks']:11.2f} "
              f"{row['overhead_iterations'] or 0:11.2f}", flush=True)
    write_results("mimose_speed", rows, threads=torch.get_num_threads(),
                  targets={"mimose_over_full": 0.85, "mimose_over_none": 1.10})


if __name__ == "__main__":
    main()
