"""The README's "in your own loop" code on the short run's workload: is the library's loop as fast
as the launcher's, and what does the meter cost it?

``Mimose(model, budget)`` and ``planner.run(step_fn, batch)`` (no ``prepare``) on the 6-layer
GPT-2 of ``short_run.py`` with its long-tailed lengths, batch 4, at 60 % of the largest peak plain
training reaches on these batches. Runs, in rotated order round after round, one thread:
- plain: the same loop without a planner and without a meter (what the user had before);
- mimose: the README's code as written (the planner builds its default meter: on the CPU the
  counting CPU allocator, ``memory/allocator.py``);
- mimose, dispatch meter: the same with the planner's own meter the dispatch-mode simulated
  device (the CPU's default before 2026-12-05, and where the allocator cannot be built);
- plain, allocator meter: the plain loop under an allocator meter of its own, each step in
  ``meter.step()``; and mimose with that meter at a budget so large that no plan checkpoints
  anything ("mimose, nothing checkpointed"): what a step costs that the planner plans but does
  not change, under the same meter (the issue's <= 1.02x).
Where mimose's time beyond plain goes is split into the recomputation of the
checkpointed blocks (``StepInfo.recompute_ms``), the probes (``probe_ms``), the rest of the
planning (``planning_ms_total`` less the probes) and what is left (hooks, the meter, noise).
Each ratio is the median over rounds of the per-round ratio of the whole loop's time (the first
step, with the probes, included) and of steps 10 on. Writes benchmarks/results/library_loop.json.

    python benchmarks/library_loop.py [--rounds 3] [--steps 60]
"""

import argparse
import contextlib
import statistics
import tempfile
import time

import torch

from mimose_cli.launcher.data.dataset import build_dataset
from mimose_cli.launcher.data.loader import build_dataloader
from mimose_cli.launcher.models import build_model, model_config
from mimose_cli import memory
from mimose_cli.memory import build_meter
from mimose_cli.planners.mimose.policy import Mimose

from _results import write_results
from short_run import recipe

RUNS = ("plain", "mimose", "mimose, dispatch meter", "plain, allocator meter", "mimose, nothing checkpointed")


def own_loop_batches(r, config, steps: int) -> list:
    loader = build_dataloader(r, build_dataset(r, config), config, epoch=0)
    return [batch for _, batch in zip(range(steps), loader)]


def own_loop(r, config, batches: list, run: str, budget) -> tuple:
    """Per-step times (ms) of the loop, and the planner's figures."""
    torch.manual_seed(0)
    model = build_model(r, config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = lambda batch: model(**batch).loss.backward()  # noqa: E731 - the README's step function
    times, stats, recompute_ms = [], {}, 0.0
    planner = None
    meter = build_meter("allocator", None) if run in ("plain, allocator meter", "mimose, nothing checkpointed") else None
    if run == "mimose, dispatch meter":
        default, memory.CPU_DEFAULT = memory.CPU_DEFAULT, "simulated"  # the kind the planner builds
        try:
            planner = Mimose(model, budget)
        finally:
            memory.CPU_DEFAULT = default
    elif run == "mimose, nothing checkpointed":
        planner = Mimose(model, 10**15, meter=meter)  # the meter's owner is this loop, as for plain's
    elif run == "mimose":
        planner = Mimose(model, budget)
    try:
        with meter.activate() if meter is not None else contextlib.nullcontext():
            if meter is not None:
                meter.track(model, optimizer)
            for batch in batches:
                start = time.perf_counter()
                if planner is None:
                    with meter.step() if meter is not None else contextlib.nullcontext():
                        step(batch)
                else:
                    planner.run(step, batch)
                    recompute_ms += planner.last.recompute_ms or 0.0
                optimizer.step()
                optimizer.zero_grad()
                times.append((time.perf_counter() - start) * 1e3)
        if planner is not None:
            stats = {k: planner.stats.get(k) for k in ("overhead_iterations", "untrusted_steps", "retries",
                                                         "probe_ms", "planning_ms_total")}
            stats["meter"] = planner.meter.kind
            stats["recompute_ms"] = recompute_ms
    finally:
        if planner is not None:
            planner.close()
    return times, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        r = recipe(out, args.steps)
        config = model_config(r)
        batches = own_loop_batches(r, config, args.steps)
        meter = build_meter("simulated", 10**12)
        with meter.activate():  # plain's largest peak on these batches, to size the budget
            model = build_model(r, config).train()
            meter.track(model)
            peak = 0
            for batch in batches:
                meter.reset_peak()
                model(**batch).loss.backward()
                model.zero_grad(set_to_none=True)
                peak = max(peak, meter.peak_bytes())
        budget = int(0.6 * peak)
        rounds = []
        for k in range(args.rounds):
            order = RUNS[k % len(RUNS):] + RUNS[:k % len(RUNS)]
            rounds.append({run: own_loop(r, config, batches, run, budget) for run in order})
    rows = []
    for run in RUNS:
        base = "plain, allocator meter" if run == "mimose, nothing checkpointed" else "plain"
        whole = statistics.median(sum(rd[run][0]) / sum(rd[base][0]) for rd in rounds)
        late = statistics.median(sum(rd[run][0][10:]) / sum(rd[base][0][10:]) for rd in rounds)
        rows.append({"run": run, "against": base, "whole_over_plain": whole, "steps_10_on_over_plain": late,
                     "first_step_ms": statistics.median(rd[run][0][0] for rd in rounds),
                     "stats": rounds[-1][run][1]})
    print(f"budget {budget} B (60 % of plain's largest peak {peak} B), {args.steps} steps, {args.rounds} rotated rounds")
    print("| run | against | whole loop | steps 10+ | first step ms | overhead (iterations) | meter |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        stats = row["stats"]
        print(f"| {row['run']} | {row['against']} | {row['whole_over_plain']:.3f}x | {row['steps_10_on_over_plain']:.3f}x | "
              f"{row['first_step_ms']:.0f} | {stats.get('overhead_iterations') or 0:.2f} | {stats.get('meter', '-')} |")
    split = where_the_time_goes(rounds, "mimose")
    print("mimose, beyond plain (median over rounds, % of plain's whole loop): "
          + ", ".join(f"{k} {v:+.1f} %" for k, v in split.items()))
    write_results("library_loop", rows, budget_bytes=budget, plain_peak_bytes=peak, steps=args.steps,
                  rounds=args.rounds, mimose_beyond_plain_percent=split)


def where_the_time_goes(rounds: list, run: str) -> dict:
    """``run``'s time beyond plain's, split into the recomputation, the probes, the rest of the
    planning and what is left, each the median over rounds in % of plain's whole loop."""
    parts = {"total": [], "recompute": [], "probes": [], "other planning": [], "rest": []}
    for rd in rounds:
        plain, (times, stats) = sum(rd["plain"][0]), rd[run]
        probes = stats.get("probe_ms") or 0.0
        planning = (stats.get("planning_ms_total") or 0.0) - probes
        beyond = sum(times) - plain
        for key, ms in (("total", beyond), ("recompute", stats["recompute_ms"]), ("probes", probes),
                        ("other planning", planning),
                        ("rest", beyond - stats["recompute_ms"] - probes - planning)):
            parts[key].append(100 * ms / plain)
    return {key: statistics.median(values) for key, values in parts.items()}


if __name__ == "__main__":
    main()
