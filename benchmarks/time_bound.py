"""How much total time finer plans can save at most, from runs of ``finer_plans.py``.

A finer plan saves time only in recompute: the rest of the step (forward, backward, optimizer)
is the same whatever a block's choice. If block-level Mimose spends a share ``s`` of the run's
time recomputing, a planner whose recompute is ``r`` times block-level's runs at best
``1 - (1 - r) * s`` of its time (no other overhead counted: torch's selective checkpointing also
runs a dispatch mode over the block's forward, which only adds). The issue asks at the middle
budgets for recompute <= 0.6x and time <= 0.92x block-level; both hold together only where
``s >= 0.08 / 0.4 = 0.2``; with no recompute at all, time <= 0.92x needs ``s >= 0.08``. ``needs``:
the recompute ratio at or below which 0.92x becomes reachable, ``1 - 0.08 / s`` ("-": not even at 0).

Per row of the given results (``benchmarks/results/<name>.json``): block-level's recompute share
``s`` (its median recompute ms over its time, the fastest round's time per step summed, as
finer_plans.py reports) and the same with its plan cost (the oracle-priced recompute, free of this
machine's noise); the best time ratio at recompute 0.6x and at 0; the measured ratios of finer plans
to block-level. Writes benchmarks/results/<--out>.json.

    python benchmarks/time_bound.py [finer_plans_paper_r3 finer_plans_squad_r3 finer_plans_base_width] [--out time_bound]
"""

import argparse
import json

from _results import RESULTS, write_results

TARGET_RECOMPUTE, TARGET_TIME = 0.6, 0.92


def bound(share: float, recompute_ratio: float) -> float:
    """The least time ratio a planner recomputing ``recompute_ratio`` x block-level's can reach
    when block-level spends ``share`` of its time recomputing."""
    return 1.0 - (1.0 - recompute_ratio) * share


def needed(share: float) -> float | None:
    """The recompute ratio at or below which time <= ``TARGET_TIME`` x block-level's becomes
    reachable; None where even no recompute at all does not reach it."""
    if share <= 0:
        return None
    ratio = 1.0 - (1.0 - TARGET_TIME) / share
    return ratio if ratio >= 0 else None


def rows_of(name: str) -> list:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"{path} not found: run benchmarks/finer_plans.py --out {name} first")
    rows = []
    for row in json.loads(path.read_text())["rows"]:
        block = row["median"].get("block")
        if not block or not block.get("time_s"):
            continue
        time_ms = block["time_s"] * 1e3
        share = block["recompute_ms"] / time_ms
        priced = block["plan_cost_ms"] / time_ms if block.get("plan_cost_ms") is not None else None
        rows.append({"results": name, "config": row["config"], "fraction": row["fraction"],
                     "recompute_share": share, "plan_cost_share": priced,
                     "best_time_at_0.6": bound(share, TARGET_RECOMPUTE), "best_time_at_0": bound(share, 0.0),
                     "recompute_needed": needed(share),
                     "time_vs_block": row.get("time_vs_block"), "recompute_vs_block": row.get("recompute_vs_block"),
                     "plan_cost_vs_block": row.get("plan_cost_vs_block")})
    return rows


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*",
                        default=["finer_plans_paper_r3", "finer_plans_squad_r3", "finer_plans_base_width"],
                        help="names of finer_plans.py results in benchmarks/results (without .json)")
    parser.add_argument("--out", default="time_bound", help="the JSON's name in benchmarks/results")
    args = parser.parse_args()
    rows = [row for name in args.results for row in rows_of(name)]
    print(f"{'config':16} {'f':>5} {'share':>6} {'priced':>6} {'best@0.6':>8} {'best@0':>7} "
          f"{'needs':>6} {'time':>6} {'recomp':>6} {'cost':>6}")
    for row in rows:
        print(f"{row['config']:16} {row['fraction']:5.2f} {row['recompute_share']:6.3f} "
              f"{_fmt(row['plan_cost_share']):>6} {row['best_time_at_0.6']:8.3f} {row['best_time_at_0']:7.3f} "
              f"{_fmt(row['recompute_needed']):>6} {_fmt(row['time_vs_block']):>6} "
              f"{_fmt(row['recompute_vs_block']):>6} {_fmt(row['plan_cost_vs_block']):>6}")
    write_results(args.out, rows, target_recompute=TARGET_RECOMPUTE, target_time=TARGET_TIME,
                  share_needed=(1 - TARGET_TIME) / (1 - TARGET_RECOMPUTE))


if __name__ == "__main__":
    main()
