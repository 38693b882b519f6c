"""What an open Mimose planner costs the code a user runs between its steps.

A planner that builds its own meter turns it on only inside its steps. This times three kinds of
between-step code (small matmuls, an evaluation forward under no_grad, the optimizer step) on the
quickstart model in three settings, interleaved round by round so the ratios are side by side:
no planner; a Mimose planner left open after a few steps; and that planner's meter kept on, as it
was before meters were step-only (the planner then held the simulated device on from construction
to ``close()``). Writes benchmarks/results/library_overhead.json.

    python benchmarks/library_overhead.py [--rounds 30]
"""

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

import mimose_cli
from mimose_cli.launcher.data.loader import make_batch
from mimose_cli.launcher.models import build_model, model_config
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.torch_private import dispatch_modes

from _results import write_results

QUICKSTART = Path(__file__).parent.parent / "recipes" / "quickstart.yaml"
SETTINGS = ("no planner", "open planner", "meter kept on (before)")


def setup():
    """Two copies of the quickstart model with AdamW: one plain, one under a Mimose planner that
    has run a few steps (sheltered and planned) and is left open. Returns (plain, planned,
    planner, batch), each of plain/planned a (model, optimizer) pair."""
    recipe = load_recipe(QUICKSTART)
    config = model_config(recipe)
    torch.manual_seed(0)
    model = build_model(recipe).train()
    twin = copy.deepcopy(model)
    planner = mimose_cli.Mimose(twin, budget=recipe.budget_bytes, sheltered_steps=2)
    optimizer = torch.optim.AdamW(twin.parameters())
    planner.track(optimizer)
    for length in (32, 64, 48, 64):
        batch = make_batch(recipe, config, (16, length))
        with planner.step(batch):
            twin(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    plain = (model, torch.optim.AdamW(model.parameters()))
    return plain, (twin, optimizer), planner, make_batch(recipe, config, (16, 64))


def workloads(batch):
    """name -> work(model, optimizer): code a user runs between planner steps."""
    a, b = torch.randn(128, 128), torch.randn(128, 128)

    def matmuls(model, optimizer):
        for _ in range(100):
            a @ b

    def eval_forward(model, optimizer):
        with torch.no_grad():
            model(**batch)

    def optimizer_step(model, optimizer):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {"100 matmuls 128x128": matmuls, "eval forward 16x64": eval_forward,
            "AdamW step": optimizer_step}


def timed(work, model, optimizer, meter=None):
    """Process CPU seconds of one call (steadier than wall time on a shared machine)."""
    start = time.process_time()
    if meter is None:
        work(model, optimizer)
    else:
        with meter.activate():
            work(model, optimizer)
    return time.process_time() - start


def measure(work, plain, planned, planner, rounds):
    """CPU ms per call in each setting, the settings interleaved every round."""
    times = {name: [] for name in SETTINGS}
    for _ in range(rounds + 1):  # the first round warms up
        times["no planner"].append(timed(work, *plain))
        times["open planner"].append(timed(work, *planned))
        times["meter kept on (before)"].append(timed(work, *planned, planner.meter))
    return {name: [t * 1e3 for t in values[1:]] for name, values in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain, planned, planner, batch = setup()
    assert dispatch_modes() == [], "the open planner left a dispatch mode on"
    rows = []
    print(f"{'between steps':<22}" + "".join(f"{name:>24}" for name in SETTINGS) + f"{'open/none':>11}{'on/none':>9}")
    for name, work in workloads(batch).items():
        times = measure(work, plain, planned, planner, args.rounds)
        median = {setting: statistics.median(values) for setting, values in times.items()}
        base = median["no planner"]
        row = {"work": name, "median_cpu_ms": median,
               "ratio_open_planner": median["open planner"] / base,
               "ratio_meter_kept_on": median["meter kept on (before)"] / base}
        rows.append(row)
        print(f"{name:<22}" + "".join(f"{median[s]:>21.2f} ms" for s in SETTINGS)
              + f"{row['ratio_open_planner']:>11.2f}{row['ratio_meter_kept_on']:>9.2f}")
    planner.close()
    write_results("library_overhead", rows, rounds=args.rounds, torch_threads=1,
                  clock="process CPU time, median of the rounds")


if __name__ == "__main__":
    main()
