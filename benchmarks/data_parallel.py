"""Two processes against one: `mimose train --nproc-per-node 2` (torchrun, gloo, the CPU) with a
budget that makes the planner checkpoint on the longer batches, against one process with twice
the batch and no budget, over the same global batches.

Reported: the largest relative difference of a step's loss, every rank's highest peak against
the budget, out-of-memory steps and retries per rank, blocks checkpointed, and the wall time of
each run. The recipe is the quickstart as sequence classification without dropout (each rank
would draw its own dropout masks; docs/DISTRIBUTED.md).

    PYTHONPATH=. python benchmarks/data_parallel.py [--steps 40] [--budget 6MB]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_results

from mimose_cli.planners.blocks import checkpointed

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["task=sequence_classification", "data.preset=qqp", "data.num_examples=400", "data.max_length=96",
          "planner.mimose.sheltered_steps=3", "training.checkpoint_every=null",
          "model.config_overrides={hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0}"]


def train(out: Path, *args) -> tuple[float, Path]:
    """``python -m mimose_cli train`` with ``args``; returns its wall time and run directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mimose_cli", "train", str(ROOT / "recipes" / "quickstart.yaml"),
                    *RECIPE, *args, "--out", str(out), "--view", "none"], env=env, check=True)
    wall_s = time.perf_counter() - start
    (run_dir,) = out.iterdir()
    return wall_s, run_dir


def lines(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--budget", default="6MB")
    args = parser.parse_args()
    budget_bytes = int(float(args.budget.removesuffix("MB")) * 10**6)
    with tempfile.TemporaryDirectory() as tmp:
        two_s, two = train(Path(tmp) / "two", "--nproc-per-node", "2", "--budget", args.budget,
                           "training.batch_size=4", f"training.max_steps={args.steps}")
        one_s, one = train(Path(tmp) / "one", "training.batch_size=8", f"training.max_steps={args.steps}")
        pairs = list(zip(lines(two), lines(one), strict=True))
        summary = json.loads((two / "summary.json").read_text())
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in pairs)
    rows = []
    for rank in summary["ranks"]:
        mine = [f for a, _ in pairs for f in a["ranks"] if f["rank"] == rank["rank"]]
        rows.append({"rank": rank["rank"], "peak_bytes": rank["peak_bytes"], "budget_bytes": budget_bytes,
                     "oom_steps": rank["oom_steps"], "retries": rank["retries"],
                     "over_budget_steps": rank["over_budget_steps"],
                     "steps_checkpointing": sum(1 for f in mine if checkpointed(f["plan"])),
                     "mean_blocks": sum(len(checkpointed(f["plan"])) for f in mine) / len(mine)})
    print(f"{args.steps} steps, global batch 8: two processes x 4 at {args.budget} vs one process x 8 unbudgeted")
    print(f"largest relative loss difference: {worst:.2e}; wall {two_s:.1f} s (two) vs {one_s:.1f} s (one)")
    print("| rank | peak MiB | budget MiB | over budget | OOM | retries | steps checkpointing | mean blocks |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rank']} | {r['peak_bytes'] / 2**20:.2f} | {budget_bytes / 2**20:.2f} | {r['over_budget_steps']} "
              f"| {r['oom_steps']} | {r['retries']} | {r['steps_checkpointing']}/{args.steps} | {r['mean_blocks']:.2f} |")
    write_results("data_parallel", rows, steps=args.steps, budget=args.budget, max_relative_loss_difference=worst,
                  wall_s_two_processes=two_s, wall_s_one_process=one_s)


if __name__ == "__main__":
    main()
