"""Mimose with finer plans (``planner.mimose.choices: selective``: each block kept, checkpointed
selectively or recomputed) against block-level Mimose (``choices: block``, the paper's plans) and
the oracle over the same choices (``planner.oracle.choices: selective``) on the same runs.

Per configuration, ``none`` and ``full`` run once to measure the largest step peak each needs;
the budgets are ``full + f * (none - full)`` for f in --fractions (tight, middle, roomy), but no
lower than 1.02 x what the pre-flight says full checkpointing needs at the recipe's largest input. At each
budget the variants run ``--rounds`` times, their order rotated every round. Per variant the table
gives the time (the sum over steps of the fastest round's time for that step: the rounds run the
same batches with the same plans, and interference from other work only adds time; the median of
the rounds' training times is in the JSON too), the median recompute time (the records'
``recompute_ms`` summed), mean blocks checkpointed and selectively checkpointed, the mean step peak
over the budget where the plan checkpoints something (binding), out-of-memory steps and retries;
then selective / block and selective / oracle. Beside the times, what this machine's noise cannot
move: each run's plans priced with one table of recompute time per block per choice at each input
size, measured by the oracles of the *other* rounds (their mean; ``plan cost``, Σ over steps of the
plan's blocks' recompute or selective times), so ``plan cost`` ratios compare the plans alone. Not
the round's own oracle's table: the oracle chose its plans on that table's noise, which would
favour it; with one round there is no other table and the round's own is used. The oracle's
tables give alike blocks (the layers of a stack that measured the same bytes) their mean
(``OraclePolicy.alike_at``), so which of them a plan picks does not move its cost by the timing
noise between them (results written before that have a second figure, ``plan_cost_alike``, that
averaged them here). Memory is the exact simulated device; times are this CPU's (Python per op
dominates tiny models, on which torch's selective checkpointing's dispatch mode costs more than the
matmuls it saves, and the scheduler's time model sees it).

Configurations: ``swag`` (the 12-layer tiny BERT of mimose_speed.py), ``bert-base-width`` (4 layers
of hidden 768), ``squad`` (lengths up to 384, widely varying), and the paper-figure configurations
of paper_figure.py (``bert-qqp``, ``bert-swag``, ``roberta-mc``; their budgets there are f = 0.05,
0.35, 0.85). Variants ``selective-whole`` and ``oracle-whole`` are Mimose's and the oracle's
finer plans without the partial levels (``features.PARTIAL_LEVELS``: no block keeps only its first
heavy outputs), for the partial levels' share of the figures (their rows compare
``selective`` with ``selective-whole``). Variant ``offload`` (Mimose's ``choices: offload``, a block freed whole offloaded
where its copies cost less than its recompute) gets the same time and recompute ratios, against
block-level Mimose and ``oracle-offload`` (the oracle's ``choices: offload``); a run that offloaded
has no plan cost (the oracle's table prices no copies; results written before 2026-12-03's second
session give it the cost of its recomputes alone, 0.0 where it offloaded every freed block).
Writes benchmarks/results/<--out>.json.

    python benchmarks/finer_plans.py [--configs swag,bert-base-width,squad] [--steps 40] [--rounds 3]
    python benchmarks/finer_plans.py --configs bert-qqp,bert-swag,roberta-mc --fractions 0.05,0.35,0.85 \\
        --steps 60 --rounds 3 --out finer_plans_paper
"""

import argparse
import contextlib
import statistics
import tempfile

import numpy as np
import torch
from mimose_safety import FLOOR, recipe_for
from paper_figure import CONFIGS as PAPER_CONFIGS
from paper_figure import fastest_steps_s, make_recipe

from mimose_cli.planners.baselines.oracle import OraclePolicy
from mimose_cli.planners.blocks import KEEP, PARTIAL_LEVELS, SELECTIVE, checkpointed
from mimose_cli.planners.mimose.choices import ChoiceTimes

from _results import run_training, write_results

CONFIGS = {  # name -> (the mimose_safety.py preset, overrides)
    "swag": ("swag", ("data.max_length=96",)),  # the 12-layer tiny BERT of mimose_speed.py, SWAG-like lengths up to 96
    "bert-base-width": ("swag", ("model.config_overrides={num_hidden_layers: 4, hidden_size: 768, intermediate_size: 3072, "
                                 "num_attention_heads: 12}", "data.max_length=128")),
    # Lengths that vary widely from batch to batch (SQuAD-like question answering, up to 384 tokens).
    "squad": ("squad", ("data.max_length=384",)),
}
VARIANTS = {  # name -> (planner, overrides)
    "block": ("mimose", ("planner.mimose.choices=block",)),
    "selective": ("mimose", ("planner.mimose.choices=selective",)),
    "oracle": ("oracle", ("planner.oracle.choices=selective",)),
    # The same without the partial levels (``features.PARTIAL_LEVELS``): a selective checkpoint
    # keeps every heavy output its recompute takes back, or the block is recomputed whole.
    "selective-whole": ("mimose", ("planner.mimose.choices=selective",)),
    "oracle-whole": ("oracle", ("planner.oracle.choices=selective",)),
    # A block freed whole offloaded where its copies, timed on this device, cost less than its
    # recompute (``planner.mimose.choices: offload``; the copies here are memcpys in one memory).
    "offload": ("mimose", ("planner.mimose.choices=offload",)),
    "oracle-offload": ("oracle", ("planner.oracle.choices=offload",)),
}
_FINER = {"selective": ("", ("block", "oracle", "selective-whole")),
          "offload": ("offload_", ("block", "oracle-offload")),
          "selective-whole": ("whole_", ("block", "oracle-whole"))}
_WHOLE = {"selective-whole", "oracle-whole"}
"""Variants run with no partial level priced (``ChoiceTimes.partial_at`` says none is known)."""
"""The variants compared, their keys' prefixes in a row, and what each is compared with: block-level
Mimose and the oracle over the same choices."""


def _recipe(config: str, steps: int, out_dir, overrides: list):
    if config in CONFIGS:
        preset, config_overrides = CONFIGS[config]
        return recipe_for(preset, steps, out_dir, *config_overrides, *overrides)
    return make_recipe(PAPER_CONFIGS[config], steps, out_dir, sheltered=5, overrides=overrides)


@contextlib.contextmanager
def without_partial_levels(off: bool):
    """With ``off``, no block may take a partial level (their times unknown), else as it is."""
    partial_at = ChoiceTimes.partial_at
    if off:
        ChoiceTimes.partial_at = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        ChoiceTimes.partial_at = partial_at


@contextlib.contextmanager
def oracles_made():
    """The oracle policies constructed inside (a list, filled as they are made): their measured
    recompute times per choice (``OraclePolicy.choice_ms``) price every variant's plans."""
    made, init = [], OraclePolicy.__init__

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    OraclePolicy.__init__ = kept
    try:
        yield made
    finally:
        OraclePolicy.__init__ = init


def plan_cost_ms(plans: dict, table: dict, steps=None) -> float | None:
    """Σ over ``steps`` (default: all of ``plans``, step -> (size, plan: one choice per block)) of
    what ``table`` (input size -> per-block recompute and selective ms[, each partial level's ms
    per block], the oracle's measurements) says the step's plan recomputes; steps at sizes without
    a table entry are left out (the same steps for every run of a round: the same batches). None
    where a block's partial level has no price in the table."""
    total = 0.0
    for step in plans if steps is None else steps:
        size, plan = plans[step]
        times = table.get(size)
        if times is not None:
            recompute, sel, *partial_ms = times
            for i in checkpointed(plan):
                if plan[i] in PARTIAL_LEVELS:
                    if not partial_ms or partial_ms[0] is None:
                        return None
                    cost = float(partial_ms[0][i, PARTIAL_LEVELS.index(plan[i])])
                else:
                    cost = float(sel[i]) if plan[i] == SELECTIVE else float(recompute[i])
                if np.isnan(cost):
                    return None
                total += cost
    return total


def run(config: str, steps: int, out_dir, planner: str, budget, overrides=(), whole: bool = False) -> dict:
    recipe = _recipe(config, steps, out_dir, [f"planner.name={planner}", f"budget={budget or 'null'}", *overrides])
    with oracles_made() as oracles, without_partial_levels(whole):
        result = run_training(recipe, view="none", recipe_name=f"finer-{config}")
    records = [r for r in result.records if not r.oom]
    if not records:
        raise SystemExit(f"{config} {planner} at budget {budget}: every step ran out of memory: "
                         f"{result.records[0].error if result.records else result.summary}")
    budget = result.summary["budget_bytes"] if budget else None
    binding = [r.peak_bytes / budget for r in records if budget and any(choice != KEEP for choice in r.plan)]
    return {"train_s": result.summary["train_time_s"], "step_ms": [r.train_ms for r in result.records],
            "recompute_ms": sum(r.recompute_ms or 0.0 for r in records),
            "peak_bytes": max(r.peak_bytes or 0 for r in records),
            "mean_peak_over_budget": (statistics.mean(r.peak_bytes for r in records) / budget if budget else None),
            "binding_peak_over_budget": statistics.mean(binding) if binding else None,
            "checkpointed": result.summary["mean_checkpointed_blocks"],
            "selective": result.summary.get("mean_selective_blocks"),
            "partial": result.summary.get("mean_partial_blocks"),
            # the oracle's finer plans: input sizes searched exactly (block by block, or every plan),
            # and by the scheduler (too many plans)
            "frontier_searches": result.summary["planner"].get("frontier_searches"),
            "exact_searches": result.summary["planner"].get("exact_searches"),
            "scheduler_searches": result.summary["planner"].get("scheduler_searches"),
            "offloaded": result.summary.get("mean_offloaded_blocks"),
            "oom_steps": sum(r.oom for r in result.records), "retries": sum(r.retries for r in result.records),
            "preflight_full_bytes": (result.summary.get("preflight") or {}).get("full_bytes"),
            # kept in memory, not written: each step's plan, and the oracle's measured table
            "_plans": {r.step: (tuple(r.input_size or ()), tuple(r.plan)) for r in records},
            "_table": ({size: (times[0], times[1], oracles[-1].partial_ms.get(size))
                        for size, times in oracles[-1].choice_ms.items() if times is not None} if oracles else None)}


def evaluate(config: str, steps: int, rounds: int, fractions: list, variants: list) -> list:
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        none_peak = run(config, steps, out_dir, "none", None)["peak_bytes"]
        full = run(config, steps, out_dir, "full", "100GB")
        full_peak, floor = full["peak_bytes"], full["preflight_full_bytes"]
        for fraction in fractions:
            # The pre-flight refuses a budget below full checkpointing's need at the largest input.
            budget = max(int(full_peak + fraction * (none_peak - full_peak)), int(FLOOR * floor))
            runs = {v: [] for v in variants}
            for round_ in range(rounds):
                order = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
                for variant in order:
                    planner, overrides = VARIANTS[variant]
                    runs[variant].append(run(config, steps, out_dir, planner, budget, overrides, variant in _WHOLE))
            price_rounds(list(zip(*runs.values())))
            median = {v: {"train_s": statistics.median(r["train_s"] for r in rs),
                          "time_s": fastest_steps_s([r["step_ms"] for r in rs]),
                          "recompute_ms": statistics.median(r["recompute_ms"] for r in rs),
                          "plan_cost_ms": _median_or_none([r.get("plan_cost_ms") for r in rs])}
                      for v, rs in runs.items()}
            row = {"config": config, "fraction": fraction, "budget_bytes": budget, "none_peak_bytes": none_peak,
                   "full_peak_bytes": full_peak, "runs": runs, "median": median}
            for mine, (key, others) in _FINER.items():
                for other in others:
                    if mine not in median or other not in median:
                        continue
                    a, b = median[mine], median[other]
                    row[f"{key}time_vs_{other}"] = a["time_s"] / b["time_s"] if a["time_s"] and b["time_s"] else None
                    row[f"{key}train_vs_{other}"] = a["train_s"] / b["train_s"]
                    row[f"{key}recompute_vs_{other}"] = (a["recompute_ms"] / b["recompute_ms"]
                                                         if b["recompute_ms"] else None)
                    # a run that offloaded has no plan cost (``price_rounds``): no ratio
                    row[f"{key}plan_cost_vs_{other}"] = _median_or_none(
                        [_ratio(x.get("plan_cost_ms"), y.get("plan_cost_ms"))
                         for x, y in zip(runs[mine], runs[other])])
            for rs in runs.values():
                for r in rs:
                    del r["_plans"], r["_table"]
            rows.append(row)
            print_row(row)
    return rows


def price_rounds(rounds: list) -> None:
    """Each run priced (``plan_cost_ms``) with the mean of the other rounds' oracle tables: per
    input size, the mean per-block times of the tables that have it."""
    tables = [next((r["_table"] for r in round_runs if r["_table"] is not None), None) for round_runs in rounds]
    for k, round_runs in enumerate(rounds):
        others = [t for j, t in enumerate(tables) if j != k and t is not None] or [t for t in tables[k:k + 1] if t]
        table = {}
        for size in {size for t in others for size in t}:
            entries = [t[size] for t in others if t.get(size) is not None]
            if entries:
                table[size] = tuple(np.mean([np.asarray(e[c]) for e in entries], axis=0) for c in (0, 1))
                partial = [e[2] for e in entries if len(e) > 2 and e[2] is not None]
                table[size] += (np.mean(partial, axis=0) if partial else None,)
        steps = set.intersection(*(set(r["_plans"]) for r in round_runs))  # a step out of memory in any run: left out
        for r in round_runs:  # a run that offloaded: its copies are in no table, so no plan cost
            priced = others and not r["offloaded"]
            r["plan_cost_ms"] = plan_cost_ms(r["_plans"], table, steps) if priced else None


def _ratio(a, b):
    if a is None or b is None:
        return None
    return a / b if b else (1.0 if not a else None)


def _median_or_none(values: list):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_row(row: dict) -> None:
    for variant, runs in row["runs"].items():
        last, m = runs[-1], row["median"][variant]
        print(f"{row['config']:16} {row['fraction']:5.2f} {variant:9} {_fmt(m['time_s'], '8.1f')} {m['train_s']:8.1f} "
              f"{m['recompute_ms']:11.0f} {last['checkpointed']:6.2f} {last['selective'] or 0:6.2f} "
              f"{last.get('partial') or 0:6.2f} "
              f"{last.get('offloaded') or 0:6.2f} "
              f"{_fmt(last['binding_peak_over_budget'], '6.3f')} "
              f"{sum(r['oom_steps'] for r in runs):4} {sum(r['retries'] for r in runs):4}", flush=True)
    for mine, (key, others) in _FINER.items():
        for other in others:
            if f"{key}time_vs_{other}" in row:
                print(f"{'':16} {'':5} {mine}/{other}: time {_fmt(row[f'{key}time_vs_{other}'], '.3f')} "
                      f"(medians {row[f'{key}train_vs_{other}']:.3f}), "
                      f"recompute {_fmt(row[f'{key}recompute_vs_{other}'], '.3f')}, "
                      f"plan cost {_fmt(row[f'{key}plan_cost_vs_{other}'], '.3f')}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="swag,bert-base-width",
                        help="comma-separated, from " + ",".join([*CONFIGS, *PAPER_CONFIGS]))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fractions", default="0.1,0.5,0.9")
    parser.add_argument("--variants", default="block,selective,oracle",
                        help="comma-separated, from " + ",".join(VARIANTS))
    parser.add_argument("--out", default="finer_plans", help="the JSON's name in benchmarks/results")
    args = parser.parse_args()
    configs, variants = args.configs.split(","), args.variants.split(",")
    unknown = [c for c in configs if c not in CONFIGS and c not in PAPER_CONFIGS] + [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown configuration or variant {unknown[0]!r}")
    torch.set_num_threads(1)
    print(f"{'config':16} {'f':>5} {'variant':9} {'time s':>8} {'median':>8} {'recompute ms':>11} {'ckpt':>6} {'sel':>6} "
          f"{'part':>6} "
          f"{'off':>6} {'peak/b':>6} {'oom':>4} {'retr':>4}")
    rows = []
    for config in configs:
        rows += evaluate(config, args.steps, args.rounds, [float(f) for f in args.fractions.split(",")], variants)
    write_results(args.out, rows, steps=args.steps, rounds=args.rounds, threads=1, variants=variants)


if __name__ == "__main__":
    main()
