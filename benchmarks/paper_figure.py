"""A CPU reproduction of the Mimose paper's main figure: normalised time per planner per budget.

Three tiny configurations stand in for the paper's tasks: BERT on QQP-like lengths (sentence-pair
classification), BERT on SWAG-like lengths (multiple choice) and RoBERTa multiple choice. Each runs
``mimose compare`` (mimose, sublinear, dtr, none, oracle; same seed and data order) at budgets from
"barely feasible" (just above full checkpointing's peak) to "almost no checkpointing needed" (just
below no checkpointing's peak), both measured first on the same data. Memory is the exact simulated
device, so "over budget" means what it would on a GPU of that size.

    python benchmarks/paper_figure.py [--steps 150] [--repeats 3] [--threads 2] [--quick]

Prints one table and writes benchmarks/results/paper_figure.json, including whether the targets
hold: mimose >= 10 % faster than sublinear and dtr at the tight budgets, within 10 % of oracle,
never over budget. Each planner runs ``--repeats`` times per budget, the order rotated every
round: single 20-second runs on a shared 2-core VM vary by ±10 %. A planner's time is the sum over
steps of the fastest round's time for that step (the same batches and plans in every round;
interference only adds time); the median of the rounds' totals is kept in the JSON too.
Beside each ratio the table shows the mean number of blocks checkpointed per step (dtr: evicted),
which is what the planners control and does not depend on the machine's noise. The oracle's
speed-up over sublinear and dtr at the tight budget is printed as the bound on what any planner
could gain there.
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from mimose_cli.launcher.recipe import recipe_from_dict
from mimose_cli.launcher.sweep import run_compare
from mimose_cli.runs.records import read_records

from _results import run_training

RESULTS = Path(__file__).parent / "results"
PLANNERS = ("mimose", "sublinear", "dtr", "oracle", "none")
BUDGET_POINTS = (0.05, 0.35, 0.85)  # where between full's and none's peaks

CONFIGS = {
    "bert-qqp": {"task": "sequence_classification", "model": {"type": "bert", "size": "tiny"},
                 "data": {"preset": "qqp", "max_length": 128, "num_examples": 2048},
                 "training": {"batch_size": 32}},
    "bert-swag": {"task": "multiple_choice", "model": {"type": "bert", "size": "tiny"},
                  "data": {"preset": "swag", "max_length": 96, "num_examples": 1024, "num_choices": 4},
                  "training": {"batch_size": 8}},
    "roberta-mc": {"task": "multiple_choice", "model": {"type": "roberta", "size": "tiny"},
                   "data": {"preset": "swag", "max_length": 96, "num_examples": 1024, "num_choices": 4},
                   "training": {"batch_size": 8}},
}


def make_recipe(config: dict, steps: int, out_dir: Path, sheltered: int, overrides=()):
    """The recipe of one configuration (``overrides``: ``key=value`` as on the command line)."""
    data = json.loads(json.dumps(config))
    data["training"].update(max_steps=steps, lr=1e-3, warmup_steps=2)
    data["planner"] = {"name": "mimose", "mimose": {"sheltered_steps": sheltered}}
    data.update(device="cpu", seed=0, out_dir=str(out_dir))
    return recipe_from_dict(data, "<paper_figure>", overrides=overrides)


def budgets_for(recipe) -> list:
    """Budgets between full checkpointing's and no checkpointing's measured peaks."""
    peaks = {}
    for name in ("full", "none"):
        recipe.planner.name = name
        peaks[name] = run_training(recipe, view="none", recipe_name=f"calibrate-{name}").summary["peak_bytes"]
    recipe.planner.name = "mimose"
    low, high = peaks["full"], peaks["none"]
    return [str(int(low + point * (high - low))) for point in BUDGET_POINTS], peaks


def step_min_time(compare_dir: Path, run: dict):
    """Σ over steps of the fastest round's time for that step (s), or None when the rounds did not
    all complete the same steps. Interference from other work on the machine only ever adds time,
    so the per-step minimum over rounds filters it out better than any whole-run statistic."""
    per_round = []
    for run_dir in run.get("run_dirs") or [run.get("run_dir")]:
        if run_dir is None:
            return None
        records = read_records(compare_dir / run_dir / "metrics.jsonl")
        if any(r.oom for r in records):
            return None
        per_round.append([r.train_ms for r in records])
    return fastest_steps_s(per_round)


def fastest_steps_s(per_round: list) -> float | None:
    """Σ over steps of the fastest round's time for that step, in s, from each round's step times
    in ms; None when the rounds ran different numbers of steps."""
    if len({len(times) for times in per_round}) != 1:
        return None
    return sum(min(step) for step in zip(*per_round)) / 1e3


def collect(name: str, compare_dir: Path, peaks: dict) -> list:
    data = json.loads((compare_dir / "compare.json").read_text())
    rows = []
    for level, entry in zip(("tight", "middle", "roomy"), data["budgets"]):
        runs = {r["planner"]: r for r in entry["runs"]}
        times = {planner: step_min_time(compare_dir, run) if run["status"] == "completed" else None
                 for planner, run in runs.items()}
        oracle_s = times["oracle"]
        for planner, run in runs.items():
            done = run["status"] == "completed"
            rows.append({
                "config": name, "level": level, "budget_bytes": entry["budget_bytes"],
                "planner": planner, "status": run["status"], "train_time_s": times[planner],
                "vs_oracle": times[planner] / oracle_s if done and oracle_s and times[planner] else None,
                "median_time_s": run["train_time_s"],
                "train_times_s": run.get("train_times_s", [run["train_time_s"]]),
                "mean_checkpointed_blocks": run.get("mean_checkpointed_blocks"),
                "recompute_ms": run.get("recompute_ms"),
                "peak_bytes": run["peak_bytes"],
                "over_budget": bool(run["peak_bytes"] and run["peak_bytes"] > entry["budget_bytes"]),
                "full_peak_bytes": peaks["full"], "none_peak_bytes": peaks["none"]})
    return rows


def targets(rows: list) -> dict:
    """The figure's claims, checked on the measured rows."""
    def time_of(config, level, planner):
        row = next(r for r in rows if (r["config"], r["level"], r["planner"]) == (config, level, planner))
        return row["train_time_s"] if row["status"] == "completed" else float("inf")

    checks = {"mimose_never_over_budget": all(not r["over_budget"] and r["status"] == "completed"
                                              for r in rows if r["planner"] == "mimose")}
    for config in sorted({r["config"] for r in rows}):
        mimose = time_of(config, "tight", "mimose")
        for other in ("sublinear", "dtr"):
            checks[f"{config}/tight: mimose >= 10% faster than {other}"] = mimose <= 0.9 * time_of(config, "tight", other)
        for level in ("tight", "middle", "roomy"):
            checks[f"{config}/{level}: mimose within 10% of oracle"] = (
                time_of(config, level, "mimose") <= 1.1 * time_of(config, level, "oracle"))
    return checks


def bounds(rows: list) -> dict:
    """At each tight budget, how much faster than sublinear and dtr the oracle itself is: no
    planner that uses the same blocks can gain more than this (up to timing noise)."""
    out = {}
    for config in sorted({r["config"] for r in rows}):
        tight = {r["planner"]: r for r in rows if (r["config"], r["level"]) == (config, "tight")}
        oracle = tight["oracle"]["train_time_s"] if tight["oracle"]["status"] == "completed" else None
        for other in ("sublinear", "dtr"):
            done = tight[other]["status"] == "completed" and oracle
            out[f"{config}/tight: oracle faster than {other} by"] = (
                1 - oracle / tight[other]["train_time_s"] if done else None)
    return out


def table(rows: list) -> Table:
    out = Table(title="time relative to oracle (mean blocks checkpointed per step)", title_justify="left")
    for column in ("config", "budget", *PLANNERS):
        out.add_column(column, justify="left" if column == "config" else "right")
    keys = sorted({(r["config"], r["level"], r["budget_bytes"]) for r in rows}, key=lambda k: (k[0], k[2]))
    for config, level, budget in keys:
        cells = []
        for planner in PLANNERS:
            row = next(r for r in rows if (r["config"], r["level"], r["planner"]) == (config, level, planner))
            ratio = "oom" if row["status"] != "completed" else f"{row['vs_oracle']:.2f}×" if row["vs_oracle"] else "-"
            blocks = row.get("mean_checkpointed_blocks")
            if row["status"] == "completed" and blocks is not None:
                ratio += f" ({blocks:.2f})"
            cells.append(ratio + (" OVER" if row["over_budget"] else ""))
        out.add_row(config, f"{level} {budget / 2**20:.1f} MiB", *cells)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per planner and budget (median)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="one configuration, 12 steps (a smoke test)")
    parser.add_argument("--out", type=Path, default=Path("runs/paper_figure"))
    parser.add_argument("--configs", help=f"comma-separated subset of {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--from-runs", action="store_true",
                        help="run nothing: rebuild the table and JSON from the run directories in --out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = {"bert-swag": CONFIGS["bert-swag"]} if args.quick else {
        name: CONFIGS[name] for name in (args.configs.split(",") if args.configs else CONFIGS)}
    steps = 12 if args.quick else args.steps
    console, rows, start = Console(), [], time.perf_counter()
    for name, config in configs.items():
        if args.from_runs:  # tables again from what an earlier run left in --out
            peaks = {kind: json.loads(next((args.out / name).glob(f"*calibrate-{kind}-{kind}/summary.json"))
                                      .read_text())["peak_bytes"] for kind in ("full", "none")}
            rows += collect(name, args.out / name / "compare", peaks)
            continue
        recipe = make_recipe(config, steps, args.out / name, sheltered=3 if args.quick else 5)
        budgets, peaks = budgets_for(recipe)
        compare_dir = run_compare(recipe, baselines=("sublinear", "dtr"), budgets=budgets,
                                  out=args.out / name / "compare", console=console, recipe_name=name,
                                  repeats=1 if args.quick else args.repeats)
        rows += collect(name, compare_dir, peaks)
    checks, limits = targets(rows), bounds(rows)
    console.print(table(rows))
    for claim, holds in checks.items():
        console.print(f"{'PASS' if holds else 'FAIL'}  {claim}")
    for claim, value in limits.items():
        console.print(f"bound  {claim} {'-' if value is None else f'{value:.1%}'}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = RESULTS / ("paper_figure_quick.json" if args.quick else "paper_figure.json")
    result.write_text(json.dumps({
        "machine": f"{platform.processor() or platform.machine()}, torch threads {args.threads}",
        "steps": steps, "repeats": 1 if args.quick else args.repeats,
        "wall_s": None if args.from_runs else time.perf_counter() - start,
        "rows": rows, "targets": checks, "oracle_bounds": limits}, indent=2))
    console.print(f"wrote {result}")


if __name__ == "__main__":
    main()
