"""Does Mimose keep every step inside the budget, use it, and train exactly like `none`?

For each synthetic preset (swag, squad, qqp; a tiny BERT on the simulated CPU device) the
budget is calibrated so that long batches must be checkpointed and short ones need not (the
60th percentile of the predicted no-checkpointing peaks of the epoch's batches), then 300
steps are trained with `mimose` and, without a budget, with `none`, through
`mimose_cli.launcher.train.run_training` on the same data order. Reported: budget overruns (the
simulated device raises out-of-memory on any), mean and min peak / budget over the steps where
the budget binds (a non-empty plan), and the largest relative loss difference to `none`
(dropout on). Targets: zero overruns, mean peak >= 85 % of the budget where it binds, loss
equal within 1e-6. Writes benchmarks/results/mimose_safety.json.

    python benchmarks/mimose_safety.py [--presets swag,qqp] [--steps 300]
"""

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from mimose_cli.launcher.data.dataset import build_dataset
from mimose_cli.launcher.data.loader import build_dataloader
from mimose_cli.launcher.models import model_config
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.planners import infer_input_size
from mimose_cli.planners.blocks import checkpointed
from mimose_cli.planners.mimose.estimator import Estimator, peak_timeline
from mimose_cli.planners.options import MimoseOptions

from _results import run_training, write_results

QUICKSTART = Path(__file__).parent.parent / "recipes" / "quickstart.yaml"
FLOOR = 1.02
"""No budget lower than this times what the pre-flight says full checkpointing needs at the
recipe's largest input (it refuses any below that figure)."""
TASKS = {"swag": "multiple_choice", "squad": "question_answering", "qqp": "sequence_classification"}


def recipe_for(preset: str, steps: int, out_dir, *overrides):
    """The preset's recipe; ``overrides`` (``key=value``) replace its settings of the same keys."""
    batch = 4 if preset == "swag" else 8  # swag: 4 choices each, so 16 sequences
    settings = [
        f"task={TASKS[preset]}", f"data.preset={preset}", f"training.max_steps={steps}",
        f"training.batch_size={batch}", f"data.num_examples={steps * batch}", "data.max_length=256",
        "model.config_overrides={num_hidden_layers: 12}", f"planner.mimose.sheltered_steps={MimoseOptions().sheltered_steps}",
        f"out_dir={out_dir}"]
    given = {o.split("=", 1)[0] for o in overrides}
    return load_recipe(QUICKSTART, [s for s in settings if s.split("=", 1)[0] not in given] + list(overrides))


def calibrate(preset: str, steps: int, out_dir, quantile: float = 0.6) -> dict:
    """A budget the long batches exceed and the short ones do not, from a sheltered-only run: the
    ``quantile`` of the batches' predicted no-checkpointing peaks, but no lower than 1.02 x what
    the pre-flight says full checkpointing needs at the recipe's largest input (which it refuses
    below; a short run's batches may all be far shorter than that input)."""
    probe = run_training(recipe_for(preset, 11, out_dir, "budget=100GB", "planner.mimose.sheltered_steps=10"),
                         view="none", recipe_name=f"calibrate-{preset}")
    state = json.loads((probe.run_dir / "estimator.json").read_text())["estimator"]
    estimator = Estimator(state["num_blocks"])
    estimator.load_state_dict(state)
    base = max(r.start_bytes for r in probe.records)
    recipe = recipe_for(preset, steps, out_dir)
    config = model_config(recipe)
    loader = build_dataloader(recipe, build_dataset(recipe, config), config, epoch=0)
    sizes = [infer_input_size(batch) for batch in loader][:steps]
    mask = np.zeros(estimator.num_blocks, dtype=bool)
    none_peaks = [base + peak_timeline(estimator.predict(s), mask).max() for s in sizes]
    floor = int(FLOOR * ((probe.summary.get("preflight") or {}).get("full_bytes") or 0))
    budget = int(np.quantile(none_peaks, quantile))
    if budget < floor:
        print(f"{preset}: the {quantile:.0%} quantile of the no-checkpointing peaks, {budget / 2**20:.2f} MiB, is below "
              f"what full checkpointing needs at the largest input; budget {floor / 2**20:.2f} MiB", flush=True)
    return {"budget_bytes": max(budget, floor), "base_bytes": int(base), "lengths": [s[-1] for s in sizes]}


def evaluate(preset: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        calibration = calibrate(preset, steps, out_dir)
        budget = calibration["budget_bytes"]
        mimose = run_training(recipe_for(preset, steps, out_dir, f"budget={budget}", "planner.name=mimose"),
                              view="none", recipe_name=f"safety-{preset}")
        none = run_training(recipe_for(preset, steps, out_dir, "planner.name=none", "budget=null"),
                            view="none", recipe_name=f"none-{preset}")
    records = mimose.records
    binding = [r for r in records if r.phase == "responsive" and checkpointed(r.plan) and not r.oom]
    ratios = [r.peak_bytes / budget for r in binding]
    losses = [(a.loss, b.loss) for a, b in zip(records, none.records)
              if a.loss is not None and b.loss is not None]
    stats = mimose.summary["planner"]
    return {"preset": preset, "steps": len(records), "budget_bytes": budget,
            "length_range": [min(calibration["lengths"]), max(calibration["lengths"])],
            "oom_steps": sum(1 for r in records if r.oom),
            "over_budget_steps": sum(1 for r in records if r.peak_bytes > budget),
            "binding_steps": len(binding), "free_steps": sum(1 for r in records if r.phase == "responsive" and not checkpointed(r.plan)),
            "binding_peak_mean_pct": 100 * float(np.mean(ratios)) if ratios else None,
            "binding_peak_min_pct": 100 * float(np.min(ratios)) if ratios else None,
            "max_peak_pct": 100 * max(r.peak_bytes for r in records) / budget,
            "loss_steps_compared": len(losses),
            "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in losses),
            "hit_rate": stats.get("hit_rate"), "misses": stats.get("misses"),
            "underpredictions": stats.get("underpredictions"),
            "mean_checkpointed_blocks": mimose.summary["mean_checkpointed_blocks"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="swag,squad,qqp")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'preset':6} {'steps':>5} {'budget MB':>9} {'OOM':>4} {'over':>4} {'binding':>7} "
          f"{'peak/budget mean %':>18} {'min %':>6} {'loss max rel diff':>17} {'hit rate':>8}")
    for preset in args.presets.split(","):
        row = evaluate(preset, args.steps)
        rows.append(row)
        print(f"{preset:6} {row['steps']:5d} {row['budget_bytes'] / 1e6:9.2f} {row['oom_steps']:4d} "
              f"{row['over_budget_steps']:4d} {row['binding_steps']:7d} {row['binding_peak_mean_pct'] or 0:18.2f} "
              f"{row['binding_peak_min_pct'] or 0:6.2f} {row['loss_max_rel_diff']:17.2e} {row['hit_rate']:8.3f}",
              flush=True)
    write_results("mimose_safety", rows,
                  targets={"over_budget_steps": 0, "binding_peak_mean_pct": 85.0, "loss_max_rel_diff": 1e-6})


if __name__ == "__main__":
    main()
