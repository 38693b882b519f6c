"""One steady-state step of Mimose against plain training, interleaved: what Mimose costs per step
once planned, with nothing to checkpoint.

The GPT-2 of ``short_run.py`` (6 layers), a 4 x 120 batch, the simulated device at the short run's
budget (under which 4 x 120 needs no checkpointing). For ``--rounds`` rounds, each of ``none``,
``mimose`` and ``full`` (every block checkpointed, for scale) is attached, steps twice to warm up
(Mimose: its probes and first plan), then 5 timed steps, and is closed; the order alternates
between rounds. Prints min and median ms of each and Mimose's median over none's; writes
benchmarks/results/steady_step.json.

    python benchmarks/steady_step.py [--rounds 8]
"""

import argparse
import statistics
import tempfile
import time

import torch
from short_run import recipe

from mimose_cli.launcher.data.loader import make_batch
from mimose_cli.launcher.models import build_model, model_config
from mimose_cli.memory import build_meter
from mimose_cli.planners.base import build_planner

from _results import write_results

BUDGET = 260307336  # short_run.py's: 60 % of plain training's largest step peak there
PLANNERS = ("none", "mimose", "full")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out_dir:
        r = recipe(out_dir, 1)
    config = model_config(r)
    model = build_model(r).train()
    batch = make_batch(r, config, (4, 120))
    meter = build_meter("simulated", BUDGET)
    times, plans = {name: [] for name in PLANNERS}, {}

    def step(planner) -> float:
        for p in model.parameters():
            p.grad = None
        start = time.perf_counter()
        with planner.step(batch):
            model(**batch).loss.backward()
        return (time.perf_counter() - start) * 1e3

    with meter.activate():
        meter.track(model)
        for n in range(args.rounds):
            for name in PLANNERS if n % 2 == 0 else PLANNERS[::-1]:
                planner = build_planner(name, model, BUDGET if name == "mimose" else None, meter=meter)
                step(planner), step(planner)
                times[name] += [step(planner) for _ in range(5)]
                plans[name] = list(planner.last.plan)
                planner.close()
    rows = [{"planner": name, "min_ms": min(v), "median_ms": statistics.median(v), "plan": plans[name]}
            for name, v in times.items()]
    for row in rows:
        print(f"{row['planner']:7} min {row['min_ms']:6.1f} ms  median {row['median_ms']:6.1f} ms  plan {row['plan']}")
    ratio = rows[1]["median_ms"] / rows[0]["median_ms"]
    print(f"mimose / none (medians): {ratio:.3f}")
    write_results("steady_step", rows, rounds=args.rounds, mimose_over_none=ratio, size=[4, 120])


if __name__ == "__main__":
    main()
