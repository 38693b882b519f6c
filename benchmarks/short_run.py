"""A short fine-tune as a new user runs it: is Mimose faster than plain training's best static peer?

A 6-layer GPT-2 from its config (n_embd 128, vocabulary 1000), causal LM on synthetic text with
long-tailed lengths (lognormal, mean 120, std 90 tokens, 16..512), batch 4, 60 steps, at a budget
of 60 % of the largest step peak plain training (``none``) reaches on these batches (measured
first, without a budget). Every planner trains the same batches with the same seed, on the
simulated device, one thread; rounds rotate the planners' order, and each ratio is the median
over rounds of the per-round ratio. Columns: the whole run, and steps 10-59 (past Mimose's
sheltered phase of earlier releases), against ``none`` without a budget and against ``hf-every-n`` (the largest
transformers ``every_n_layers`` stride whose largest batch fits, found before training);
Mimose's own accounting of its overhead in iterations (the median over rounds): its probe steps
before step 0, fits and planning, over its mean iteration. Then one sheltered step taken apart:
its time against a plain step with every block checkpointed (``full``), the measuring runs
added, and the per-op probe added (the probe switched off for one measurement).
Beside the launcher's path, the README's own loop (``Mimose(model, budget)`` and ``planner.run``,
``library_loop.py``) on the same batches and budget, in the same rotated rounds: its whole loop and
steps 10 on against the same loop without a planner.
Writes benchmarks/results/short_run.json.

    python benchmarks/short_run.py [--rounds 3] [--steps 60]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mimose_cli.launcher.data.loader import make_batch
from mimose_cli.launcher.models import build_model, model_config
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.memory import build_meter
from mimose_cli.memory import probe as live_probe
from mimose_cli.planners.base import build_planner
from mimose_cli.planners.mimose.policy import Mimose

from _results import run_training, write_results

QUICKSTART = Path(__file__).parent.parent / "recipes" / "quickstart.yaml"
MODEL = ["task=causal_lm", "model.type=gpt2", "model.attn_implementation=eager",
         "model.config_overrides={n_layer: 6, n_embd: 128, n_head: 4, vocab_size: 1000, n_positions: 512}",
         "data.preset=squad", "data.length_mean=120", "data.length_std=90", "data.min_length=16",
         "data.max_length=512", "data.num_examples=400", "training.batch_size=4", "training.cpu_threads=1",
         "training.checkpoint_every=null", "training.warmup_steps=0"]
PLANNERS = ("none", "hf-every-n", "sublinear", "mimose")


def recipe(out_dir, steps: int, *overrides):
    return load_recipe(QUICKSTART, MODEL + [f"training.max_steps={steps}", f"out_dir={out_dir}", *overrides])


def run(out_dir, steps: int, planner: str, budget) -> dict:
    result = run_training(recipe(out_dir, steps, f"planner.name={planner}", f"budget={budget or 'null'}"),
                          view="none", recipe_name=f"short-{planner}", save=False)
    summary = result.summary
    assert summary["status"] == "completed", (planner, summary.get("error"))
    times = [r.iter_ms for r in result.records]
    return {"whole_s": summary["train_time_s"], "late_ms": sum(times[10:]), "stats": summary["planner"],
            "blocks": summary["mean_checkpointed_blocks"], "peak": summary["peak_bytes"]}


def sheltered_breakdown(out_dir, size=(4, 256), repeats=5) -> dict:
    """Median ms of one step at ``size``: none, full, a sheltered step, and one without its probe."""
    r = recipe(out_dir, 1)
    config = model_config(r)
    model = build_model(r).train()
    batch = make_batch(r, config, size)

    def timed(planner):
        times = []
        for _ in range(repeats + 1):
            for p in model.parameters():
                p.grad = None
            start = time.perf_counter()
            with planner.step(batch):
                model(**batch).loss.backward()
            times.append((time.perf_counter() - start) * 1e3)
        planner.close()
        return statistics.median(times[1:])

    meter = build_meter("simulated", 10**10)
    with meter.activate():
        meter.track(model)
        ms = {name: timed(build_planner(name, model, None, meter=meter)) for name in ("none", "full")}
        ms["sheltered"] = timed(Mimose(model, "10GB", meter=meter, estimate="sheltered",
                                                 sheltered_steps=10**6))
        dispatch = live_probe.LiveProbe.__torch_dispatch__
        live_probe.LiveProbe.__torch_dispatch__ = lambda self, func, types, args=(), kwargs=None: func(
            *args, **(kwargs or {}))
        try:
            ms["sheltered_without_probe"] = timed(Mimose(model, "10GB", meter=meter, estimate="sheltered",
                                                 sheltered_steps=10**6))
        finally:
            live_probe.LiveProbe.__torch_dispatch__ = dispatch
    none = ms["none"]
    return {"size": list(size), "ms": ms,
            "in_plain_steps": {"checkpointing_every_block": (ms["full"] - none) / none,
                               "measuring_runs": (ms["sheltered_without_probe"] - ms["full"]) / none,
                               "probe": (ms["sheltered"] - ms["sheltered_without_probe"]) / none}}


def _median_stat(rounds: list, planner: str, key: str):
    """The median over rounds of one of the planner's stats (None where it has none)."""
    values = [r[planner]["stats"].get(key) for r in rounds]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from library_loop import RUNS as OWN_RUNS, own_loop_batches, own_loop  # it imports this module

    with tempfile.TemporaryDirectory() as out_dir:
        plain_peak = run(out_dir, args.steps, "none", None)["peak"]
        budget = int(0.6 * plain_peak)
        own_recipe = recipe(out_dir, args.steps)
        own_config = model_config(own_recipe)
        own_batches = own_loop_batches(own_recipe, own_config, args.steps)
        own_runs = OWN_RUNS[:2]  # plain and the README's code as written
        everything = PLANNERS + tuple(f"own loop: {name}" for name in own_runs)
        rounds, own = [], []
        for n in range(args.rounds):
            order = everything[n % len(everything):] + everything[:n % len(everything)]
            launched, looped = {}, {}
            for name in order:
                if name.startswith("own loop: "):
                    looped[name[len("own loop: "):]] = own_loop(own_recipe, own_config, own_batches,
                                                                name[len("own loop: "):], budget)[0]
                else:
                    launched[name] = run(out_dir, args.steps, name, None if name == "none" else budget)
            rounds.append(launched)
            own.append(looped)
        breakdown = sheltered_breakdown(out_dir)

    def ratio(key, a, b):
        return statistics.median(r[a][key] / r[b][key] for r in rounds)

    rows = [{"planner": p,
             "whole_over_none": ratio("whole_s", p, "none"), "late_over_none": ratio("late_ms", p, "none"),
             "whole_over_every_n": ratio("whole_s", p, "hf-every-n"),
             "late_over_every_n": ratio("late_ms", p, "hf-every-n"),
             "mean_checkpointed_blocks": rounds[-1][p]["blocks"], "peak_bytes": rounds[-1][p]["peak"],
             "every_n_layers": rounds[-1][p]["stats"].get("every_n_layers"),
             "overhead_iterations": _median_stat(rounds, p, "overhead_iterations"),
             "estimate_source": rounds[-1][p]["stats"].get("estimate_source"),
             "probe_ms": _median_stat(rounds, p, "probe_ms"),
             "overhead_ms": _median_stat(rounds, p, "overhead_ms"),
             "sheltered_extra_iterations": rounds[-1][p]["stats"].get("sheltered_extra_iterations")}
            for p in PLANNERS]
    print(f"budget {budget / 2**20:.2f} MiB (60 % of plain's peak {plain_peak / 2**20:.2f} MiB), "
          f"{args.steps} steps, median of {args.rounds} rotated rounds")
    print(f"{'planner':11} {'/none':>6} {'/none 10+':>9} {'/every-n':>8} {'/every-n 10+':>12} {'blocks':>6} "
          f"{'overhead it':>11} {'sheltered extra it':>18}")
    for r in rows:
        print(f"{r['planner']:11} {r['whole_over_none']:6.3f} {r['late_over_none']:9.3f} "
              f"{r['whole_over_every_n']:8.3f} {r['late_over_every_n']:12.3f} {r['mean_checkpointed_blocks']:6.2f} "
              f"{r['overhead_iterations'] or 0:11.2f} {r['sheltered_extra_iterations'] or 0:18.2f}")
    mimose = rows[-1]
    print(f"mimose's estimate from: {mimose['estimate_source']}; probes {mimose['probe_ms'] or 0:.0f} ms, "
          f"all overhead {mimose['overhead_ms'] or 0:.0f} ms")
    parts = breakdown["in_plain_steps"]
    print(f"one sheltered step at {tuple(breakdown['size'])}, in plain steps beyond one: "
          + ", ".join(f"{k.replace('_', ' ')} +{v:.2f}" for k, v in parts.items()))
    own_loop_ratios = {"whole_over_plain": statistics.median(sum(r["mimose"]) / sum(r["plain"]) for r in own),
                       "steps_10_on_over_plain": statistics.median(sum(r["mimose"][10:]) / sum(r["plain"][10:])
                                                                   for r in own)}
    print(f"the README's own loop (Mimose(model, budget), planner.run): whole loop "
          f"{own_loop_ratios['whole_over_plain']:.3f}x the same loop without a planner, steps 10+ "
          f"{own_loop_ratios['steps_10_on_over_plain']:.3f}x")
    write_results("short_run", rows, budget_bytes=budget, plain_peak_bytes=plain_peak, steps=args.steps,
                  rounds=args.rounds, sheltered_breakdown=breakdown, own_loop=own_loop_ratios,
                  targets={"mimose_whole_over_none": 1.06, "mimose_whole_over_every_n": 0.85,
                           "overhead_iterations": 1.0})


if __name__ == "__main__":
    main()
