"""Do two trees train the same? Compare two ``paper_figure.py --out DIR`` result directories step
by step: for every configuration, budget and planner, the plan, peak, prediction and loss of each
step, and the run's status.

    python benchmarks/same_behaviour.py BEFORE_DIR AFTER_DIR

Used to show that a refactor changed no plan, peak or loss (docs/BENCHMARKS.md). Steps are read
with ``runs.records.read_records``, so a run of the previous release (a plan in four fields) and
one of this release (one choice per block) compare plan for plan. Oracle and DTR
choose by measured time (oracle: least recompute time, ties by forward ms; DTR: eviction cost), so
their plans may differ between any two runs of the same tree; the others' may not. Writes
benchmarks/results/same_behaviour.json.
"""

import argparse
import json
from pathlib import Path

from _results import write_results

from mimose_cli.runs.records import read_records

FIELDS = {"plans": "plan", "peaks": "peak_bytes", "predictions": "predicted_peak_bytes", "losses": "loss"}
"""Column name: the ``StepRecord`` field compared step by step."""


def steps(compare_dir: Path, run: dict) -> list:
    """The ``StepRecord``s of one run of a compare directory (old plans converted)."""
    return read_records(compare_dir / run["run_dir"] / "metrics.jsonl")


def compare_config(before: Path, after: Path) -> list:
    a, b = (json.loads((d / "compare" / "compare.json").read_text()) for d in (before, after))
    rows = []
    for budget_a, budget_b in zip(a["budgets"], b["budgets"]):
        if budget_a["budget"] != budget_b["budget"]:
            raise SystemExit(f"{before.name}: calibrated budgets differ: {budget_a['budget']} vs {budget_b['budget']}")
        for run_a, run_b in zip(budget_a["runs"], budget_b["runs"]):
            sa, sb = steps(before / "compare", run_a), steps(after / "compare", run_b)
            row = {"config": before.name, "budget": budget_a["budget"], "planner": run_a["planner"],
                   "steps": [len(sa), len(sb)], "status": [run_a["status"], run_b["status"]]}
            row.update({f"same_{name}": same(sa, sb, key) for name, key in FIELDS.items()})
            rows.append(row)
    return rows


def same(records_a: list, records_b: list, name: str) -> bool:
    """Whether two runs' steps have the same ``name`` field, step for step."""
    return [getattr(r, name) for r in records_a] == [getattr(r, name) for r in records_b]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    configs = sorted(p.name for p in args.after.iterdir() if (p / "compare" / "compare.json").exists())
    rows = [row for name in configs for row in compare_config(args.before / name, args.after / name)]
    print(f"{'config':11} {'budget':>10} {'planner':10} {'steps':>8}  plans peaks pred  loss  status")
    for r in rows:
        print(f"{r['config']:11} {r['budget']:>10} {r['planner']:10} {'/'.join(map(str, r['steps'])):>8}  "
              + "  ".join(f"{'same' if r['same_' + n] else 'DIFF':4}" for n in FIELDS) + f"  {'/'.join(r['status'])}")
    write_results("same_behaviour", rows, before=str(args.before), after=str(args.after))


if __name__ == "__main__":
    main()
