"""Do two trees train the same? Compare two ``paper_figure.py --out DIR`` result directories step
by step: for every configuration, budget and planner, the plan, peak, prediction and loss of each
step, and the run's status.

    python benchmarks/same_behaviour.py BEFORE_DIR AFTER_DIR
    python benchmarks/same_behaviour.py --robustness BEFORE.json AFTER.json

The second form compares two ``robustness.py`` results cell by cell: every figure but timings
(out-of-memory steps, retries, prediction errors, peaks against the budget, losses, and every
planner counter that is not a time).

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


TIMED = ("_ms", "wall_s", "_s_", "iteration")
"""What names a time in a robustness cell: not compared (timings vary from run to run)."""


def flat(cell: dict, prefix: str = "") -> dict:
    """A robustness cell's figures by dotted name, timings left out."""
    out = {}
    for key, value in cell.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        elif not any(mark in key for mark in TIMED):
            out[prefix + key] = value
    return out


def compare_robustness(before: Path, after: Path) -> None:
    cells = {}
    for side, path in (("before", before), ("after", after)):
        for row in json.loads(path.read_text())["rows"]:
            cells.setdefault((row["model"], row["setting"], row["budget_pct"]), {})[side] = flat(row)
    rows, differing = [], 0
    for key, pair in sorted(cells.items()):
        a, b = pair.get("before", {}), pair.get("after", {})
        diff = sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))
        differing += bool(diff)
        rows.append({"cell": "/".join(map(str, key)), "differs": diff,
                     "values": {name: [a.get(name), b.get(name)] for name in diff}})
        if diff:
            print(f"{rows[-1]['cell']:28} DIFF {', '.join(f'{n} {a.get(n)!r} -> {b.get(n)!r}' for n in diff)}")
    print(f"{len(rows) - differing} of {len(rows)} cells identical in every figure but timings")
    write_results("same_behaviour_robustness", rows, before=str(before), after=str(after))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--robustness", action="store_true", help="compare two robustness.py JSON results")
    args = parser.parse_args()
    if args.robustness:
        return compare_robustness(args.before, args.after)
    configs = sorted(p.name for p in args.after.iterdir() if (p / "compare" / "compare.json").exists())
    rows = [row for name in configs for row in compare_config(args.before / name, args.after / name)]
    print(f"{'config':11} {'budget':>10} {'planner':10} {'steps':>8}  plans peaks pred  loss  status")
    for r in rows:
        print(f"{r['config']:11} {r['budget']:>10} {r['planner']:10} {'/'.join(map(str, r['steps'])):>8}  "
              + "  ".join(f"{'same' if r['same_' + n] else 'DIFF':4}" for n in FIELDS) + f"  {'/'.join(r['status'])}")
    write_results("same_behaviour", rows, before=str(args.before), after=str(args.after))


if __name__ == "__main__":
    main()
