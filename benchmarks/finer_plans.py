"""Mimose with finer plans (``planner.mimose.choices: selective``: each block kept, checkpointed
selectively or recomputed) against block-level Mimose (``choices: block``, the paper's plans) on
the same runs.

Per configuration, ``none`` and ``full`` run once to measure the largest step peak each needs;
the budgets are ``full + f * (none - full)`` for f in --fractions (tight, middle, roomy), but no
lower than 1.02 x what the pre-flight says full checkpointing needs at the recipe's largest input. At each
budget both Mimose variants run ``--rounds`` times, their order rotated; the table gives the
medians of training time and of recompute time (the records' ``recompute_ms`` summed), the ratios
of the medians (selective / block), mean blocks checkpointed and selectively checkpointed, the
mean peak over the budget, out-of-memory steps and retries. Memory is the exact simulated
device; times are this CPU's (Python per op dominates tiny models, on which torch's selective
checkpointing's dispatch mode costs more than the matmuls it saves, and the scheduler's time
model sees it). Writes benchmarks/results/finer_plans.json.

    python benchmarks/finer_plans.py [--configs swag,bert-base-width,squad] [--steps 40] [--rounds 3]
"""

import argparse
import statistics
import tempfile

import torch
from mimose_safety import recipe_for

from mimose_cli.launcher.train import run_training

from _results import write_results

CONFIGS = {  # name -> (the mimose_safety.py preset, overrides)
    "swag": ("swag", ("data.max_length=96",)),  # the 12-layer tiny BERT of mimose_speed.py, SWAG-like lengths up to 96
    "bert-base-width": ("swag", ("model.config_overrides={num_hidden_layers: 4, hidden_size: 768, intermediate_size: 3072, "
                                 "num_attention_heads: 12}", "data.max_length=128")),
    # Lengths that vary widely from batch to batch (SQuAD-like question answering, up to 384 tokens).
    "squad": ("squad", ("data.max_length=384",)),
}


def run(config: str, steps: int, out_dir, planner: str, budget, choices: str = "block") -> dict:
    preset, config_overrides = CONFIGS[config]
    overrides = [*config_overrides, f"planner.name={planner}", f"budget={budget or 'null'}",
                 f"planner.mimose.choices={choices}"]
    result = run_training(recipe_for(preset, steps, out_dir, *overrides), view="none", recipe_name=f"finer-{config}")
    records = [r for r in result.records if not r.oom]
    peak = max((r.peak_bytes or 0 for r in records), default=None)
    if not records:
        raise SystemExit(f"{config} {planner} at budget {budget}: every step ran out of memory: "
                         f"{result.records[0].error if result.records else result.summary}")
    return {"train_s": result.summary["train_time_s"],
            "recompute_ms": sum(r.recompute_ms or 0.0 for r in records),
            "peak_bytes": peak, "mean_peak_over_budget": (statistics.mean(r.peak_bytes for r in records) / result.summary["budget_bytes"]
                                                          if budget else None),
            "checkpointed": result.summary["mean_checkpointed_blocks"],
            "selective": result.summary.get("mean_selective_blocks"),
            "oom_steps": sum(r.oom for r in result.records), "retries": sum(r.retries for r in result.records),
            "preflight_full_bytes": (result.summary.get("preflight") or {}).get("full_bytes")}


def evaluate(config: str, steps: int, rounds: int, fractions: list) -> list:
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        none_peak = run(config, steps, out_dir, "none", None)["peak_bytes"]
        full = run(config, steps, out_dir, "full", "100GB")
        full_peak, floor = full["peak_bytes"], full["preflight_full_bytes"]
        for fraction in fractions:
            # The pre-flight refuses a budget below full checkpointing's need at the largest input.
            budget = max(int(full_peak + fraction * (none_peak - full_peak)), int(1.02 * floor))
            runs = {"block": [], "selective": []}
            for round_ in range(rounds):
                for choices in (("block", "selective") if round_ % 2 == 0 else ("selective", "block")):
                    runs[choices].append(run(config, steps, out_dir, "mimose", budget, choices))
            median = {c: {q: statistics.median(r[q] for r in rs) for q in ("train_s", "recompute_ms")}
                      for c, rs in runs.items()}
            rows.append({"config": config, "fraction": fraction, "budget_bytes": budget, "none_peak_bytes": none_peak,
                         "full_peak_bytes": full_peak, "runs": runs, "median": median,
                         "train_ratio": median["selective"]["train_s"] / median["block"]["train_s"],
                         "recompute_ratio": (median["selective"]["recompute_ms"] / median["block"]["recompute_ms"]
                                             if median["block"]["recompute_ms"] else None)})
            print_row(rows[-1])
    return rows


def print_row(row: dict) -> None:
    for choices in ("block", "selective"):
        last = row["runs"][choices][-1]
        m = row["median"][choices]
        print(f"{row['config']:16} {row['fraction']:5.2f} {choices:9} {m['train_s']:8.1f} {m['recompute_ms']:11.0f} "
              f"{last['checkpointed']:6.2f} {last['selective'] or 0:6.2f} {last['mean_peak_over_budget']:6.3f} "
              f"{sum(r['oom_steps'] for r in row['runs'][choices]):4} {sum(r['retries'] for r in row['runs'][choices]):4}",
              flush=True)
    recompute = "n/a" if row["recompute_ratio"] is None else f"{row['recompute_ratio']:.3f}"
    print(f"{'':16} {'':5} selective/block: time {row['train_ratio']:.3f}, recompute {recompute}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="swag,bert-base-width")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fractions", default="0.1,0.5,0.9")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'config':16} {'f':>5} {'choices':9} {'train s':>8} {'recompute ms':>11} {'ckpt':>6} {'sel':>6} "
          f"{'peak/b':>6} {'oom':>4} {'retr':>4}")
    rows = []
    for config in args.configs.split(","):
        rows += evaluate(config, args.steps, args.rounds, [float(f) for f in args.fractions.split(",")])
    write_results("finer_plans", rows, steps=args.steps, rounds=args.rounds, threads=1)


if __name__ == "__main__":
    main()
