"""The README's "in your own loop" code on the short run's workload: is the library's loop as fast
as the launcher's, and what does the meter cost it?

``Mimose(model, budget)`` and ``planner.run(step_fn, batch)`` (no ``prepare``) on the 6-layer
GPT-2 of ``short_run.py`` with its long-tailed lengths, batch 4, at 60 % of the largest peak plain
training reaches on these batches. Runs, in rotated order round after round, one thread:
- plain: the same loop without a planner and without a meter (what the user had before);
- mimose: the README's code as written (the planner builds its default meter: on the CPU the
  dispatch-mode simulated device);
- mimose, allocator meter: the same with ``meter=build_meter("allocator", budget)`` (the counting
  CPU allocator, ``memory/allocator.py``).
Each ratio is the median over rounds of the per-round ratio of the whole loop's time (the first
step, with the probes, included) and of steps 10 on. Writes benchmarks/results/library_loop.json.

    python benchmarks/library_loop.py [--rounds 3] [--steps 60]
"""

import argparse
import statistics
import tempfile
import time

import torch

from mimose_cli.launcher.data.dataset import build_dataset
from mimose_cli.launcher.data.loader import build_dataloader
from mimose_cli.launcher.models import build_model, model_config
from mimose_cli.memory import build_meter
from mimose_cli.planners.mimose.policy import Mimose

from _results import write_results
from short_run import recipe

RUNS = ("plain", "mimose", "mimose, allocator meter")


def own_loop_batches(r, config, steps: int) -> list:
    loader = build_dataloader(r, build_dataset(r, config), config, epoch=0)
    return [batch for _, batch in zip(range(steps), loader)]


def own_loop(r, config, batches: list, run: str, budget) -> tuple:
    """Per-step times (ms) of the loop, and the planner's figures."""
    torch.manual_seed(0)
    model = build_model(r, config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = lambda batch: model(**batch).loss.backward()  # noqa: E731 - the README's step function
    times, stats = [], {}
    planner = None
    if run != "plain":
        meter = build_meter("allocator", budget) if "allocator" in run else None
        planner = Mimose(model, budget, meter=meter)
    try:
        for batch in batches:
            start = time.perf_counter()
            if planner is None:
                step(batch)
            else:
                planner.run(step, batch)
            optimizer.step()
            optimizer.zero_grad()
            times.append((time.perf_counter() - start) * 1e3)
        if planner is not None:
            stats = {k: planner.stats.get(k) for k in ("overhead_iterations", "untrusted_steps", "retries")}
            stats["meter"] = planner.meter.kind
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
        whole = statistics.median(sum(rd[run][0]) / sum(rd["plain"][0]) for rd in rounds)
        late = statistics.median(sum(rd[run][0][10:]) / sum(rd["plain"][0][10:]) for rd in rounds)
        rows.append({"run": run, "whole_over_plain": whole, "steps_10_on_over_plain": late,
                     "first_step_ms": statistics.median(rd[run][0][0] for rd in rounds),
                     "stats": rounds[-1][run][1]})
    print(f"budget {budget} B (60 % of plain's largest peak {peak} B), {args.steps} steps, {args.rounds} rotated rounds")
    print("| run | whole loop / plain | steps 10+ / plain | first step ms | overhead (iterations) | meter |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        stats = row["stats"]
        print(f"| {row['run']} | {row['whole_over_plain']:.3f}x | {row['steps_10_on_over_plain']:.3f}x | "
              f"{row['first_step_ms']:.0f} | {stats.get('overhead_iterations') or 0:.2f} | {stats.get('meter', '-')} |")
    write_results("library_loop", rows, budget_bytes=budget, plain_peak_bytes=peak, steps=args.steps,
                  rounds=args.rounds)


if __name__ == "__main__":
    main()
