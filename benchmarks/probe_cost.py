"""What Mimose's probe steps cost before step 0: with a long stack's middle layers left out, with
every layer run, and with every block measured, interleaved in one process.

For the 60-step GPT-2 of ``short_run.py`` (6 layers) and the 12-layer tiny BERT of
``mimose_speed.py --presets swag``: the model from its config on the simulated device, one thread;
``planner.prepare`` (Mimose's two probe steps, their scaling and the fit) is timed ``--repeats`` times
in each mode, the modes rotating, after one warm-up each. Modes: ``left out`` (the default: a
group of blocks alike takes its plain run from its first block, the next one stands for the layers
between it and the group's last, which are not run; docs/MIMOSE.md), ``second leads`` (as before:
the group's second block measured and standing for the rest, the third for the layers left out),
``every layer``
(``stack_runs`` switched off: every layer runs, blocks alike still measured once) and ``every
block`` (``twin_blocks`` switched off too: every block gets its measuring run).
Also one ordinary training step of the recipe's mean batch shape, for scale. Prints min and
median ms and the ratio of the medians; writes benchmarks/results/probe_cost.json.

    python benchmarks/probe_cost.py [--repeats 9]
"""

import argparse
import statistics
import tempfile
import time

import torch
from mimose_safety import recipe_for
from short_run import recipe as short_recipe

from mimose_cli.launcher.data.loader import make_batch
from mimose_cli.launcher.models import build_model, model_config
from mimose_cli.memory import build_meter
from mimose_cli.planners.mimose.policy import Mimose
from mimose_cli.planners.mimose import probes as probes_module
from mimose_cli.planners.trial import loss_of, run_model

from _results import write_results

MODES = ("left out", "second leads", "every layer", "every block")


def _prepare_ms(model, make, max_size, meter, mode: str) -> tuple:
    real = probes_module.twin_blocks, probes_module.stack_runs
    if mode == "second leads":  # as before a group's first block stood for the rest
        probes_module.twin_blocks = lambda blocks, first_leads=True: real[0](blocks, first_leads=False)
    if mode in ("every layer", "every block"):
        probes_module.stack_runs = lambda blocks, twins: ([], "switched off")
    if mode == "every block":
        probes_module.twin_blocks = lambda blocks, first_leads=True: {}
    try:
        planner = Mimose(model, "100GB", meter=meter)
        start = time.perf_counter()
        planner.prepare(make, max_size)
        ms = (time.perf_counter() - start) * 1e3
        stats = planner.stats
        planner.close()
    finally:
        probes_module.twin_blocks, probes_module.stack_runs = real
    assert stats["estimate_source"] == "probes", stats["estimate_fallback"]
    return ms, stats["probe_steps"], stats["probe_twins"], stats["probe_skipped"]


def measure(name: str, recipe, max_size: tuple, step_size: tuple, repeats: int) -> dict:
    config = model_config(recipe)
    model = build_model(recipe).train()
    make = lambda size: make_batch(recipe, config, size)  # noqa: E731
    meter = build_meter("simulated", 10**11)
    times = {mode: [] for mode in MODES}
    counts = {}
    with meter.activate():
        meter.track(model)
        for round_ in range(repeats + 1):
            for mode in MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]:
                ms, steps, twins, skipped = _prepare_ms(model, make, max_size, meter, mode)
                counts[mode] = {"probe_steps": steps, "probe_twins": twins, "probe_skipped": skipped}
                if round_:  # the first round warms up
                    times[mode].append(ms)
        batch = make(step_size)
        step_ms = []
        for _ in range(4):
            start = time.perf_counter()
            loss_of(run_model(model, batch)).backward()
            step_ms.append((time.perf_counter() - start) * 1e3)
            model.zero_grad(set_to_none=True)
    medians = {mode: statistics.median(times[mode]) for mode in MODES}
    return {"model": name, "max_size": list(max_size), "step_size": list(step_size),
            "step_ms": statistics.median(step_ms[1:]),
            "modes": {mode: {"min_ms": min(times[mode]), "median_ms": medians[mode], **counts[mode]} for mode in MODES},
            "left_out_over_second_leads": medians["left out"] / medians["second leads"],
            "left_out_over_every_layer": medians["left out"] / medians["every layer"],
            "left_out_over_every_block": medians["left out"] / medians["every block"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out_dir:
        cases = [("gpt2 (short_run)", short_recipe(out_dir, 1), (4, 512), (4, 120)),
                 ("bert-12 (swag)", recipe_for("swag", 1, out_dir), (16, 256), (16, 64))]
        rows = [measure(name, r, max_size, step_size, args.repeats) for name, r, max_size, step_size in cases]
    print(f"{'model':18} {'mode':12} {'steps':>5} {'alike':>5} {'left out':>8} {'min ms':>7} {'median ms':>9} "
          f"{'in steps':>8}")
    for row in rows:
        for mode, m in row["modes"].items():
            print(f"{row['model']:18} {mode:12} {m['probe_steps']:5} {m['probe_twins']:5} {m['probe_skipped']:8} "
                  f"{m['min_ms']:7.0f} "
                  f"{m['median_ms']:9.0f} {m['median_ms'] / row['step_ms']:8.2f}")
        print(f"{row['model']:18} left out / second leads: {row['left_out_over_second_leads']:.3f}, "
              f"/ every layer: {row['left_out_over_every_layer']:.3f}, "
              f"/ every block: {row['left_out_over_every_block']:.3f} "
              f"(one step of {tuple(row['step_size'])}: {row['step_ms']:.0f} ms)")
    write_results("probe_cost", rows, repeats=args.repeats, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
