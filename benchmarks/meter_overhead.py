"""How much slower a training step runs with each CPU meter on.

Times a tiny BERT multiple-choice step (forward, backward, AdamW) with no meter, with the
dispatch-mode meter ("simulated") and with the counting allocator ("allocator"), in rotated
order each round so the ratios are measured side by side, on the recipe-sized batch and on a
dispatch-bound one, and writes benchmarks/results/meter_overhead.json. Wall and process-CPU
times are both reported: on a shared machine CPU time is the steadier of the two. Each workload
runs in a fresh process, whose first plain steps run before the allocator is installed
("installed_off": what the installed allocator costs a step with no meter on, two phases).

    python benchmarks/meter_overhead.py [--round-scale 1.0]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from mimose_cli.launcher.data.loader import make_batch
from mimose_cli.launcher.models import build_model, model_config
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.memory import build_meter
from mimose_cli.torch_private import TorchDispatchMode

RESULTS = Path(__file__).parent / "results" / "meter_overhead.json"


QUICKSTART = Path(__file__).parent.parent / "recipes" / "quickstart.yaml"


def build(seq_len, batch_size, choices):
    """The quickstart recipe's model (random init), its AdamW and one batch of this size."""
    recipe = load_recipe(QUICKSTART, [f"data.num_choices={choices}"])
    config = model_config(recipe)
    model = build_model(recipe).train()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    batch = make_batch(recipe, config, (batch_size * choices, seq_len))
    return model, optimizer, batch


def make_step(model, optimizer, batch):
    def train_step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_step


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_ops(train_step):
    """ATen ops one step dispatches: the meter's per-op cost is paid this many times."""
    with _OpCounter() as counter:
        train_step()
    return counter.ops


def timed(train_step, meter=None):
    """(wall, CPU) seconds of one step; CPU time (all threads) is robust to a busy machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    if meter is None:
        train_step()
    else:
        with meter.step():
            train_step()
    return time.perf_counter() - wall, time.process_time() - cpu


METERS = ("simulated", "allocator")
"""The meters timed against no meter: the dispatch-mode meter and the counting allocator."""


def measure(train_step, model, optimizer, batch, rounds):
    """Step times with no meter and with each meter, in rotated order each round so that drift
    and cache warmth hit all alike; returns ({name: [(wall, cpu)]}, {meter: peak bytes})."""
    # Before the allocator is installed (each workload runs in a fresh process, ``main``): what
    # an installed allocator costs steps when no meter is on is plain(rotated) / this.
    before_install = [timed(train_step) for _ in range(rounds)]
    meters = {kind: build_meter(kind) for kind in METERS}
    for meter in meters.values():  # warm-up with each meter on
        with meter.activate():
            meter.track(model, optimizer, batch)
            timed(train_step, meter)
    timed(train_step)
    names = ("plain", *METERS)
    times = {name: [] for name in names}
    times["before_install"] = before_install
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            if name == "plain":
                times[name].append(timed(train_step))
                continue
            with meters[name].activate():
                times[name].append(timed(train_step, meters[name]))
    return times, {kind: meter.peak_bytes() for kind, meter in meters.items()}


def summarize(times, ops):
    """Per meter, clock (wall, CPU) and statistic (min, median): step ms, ratio to no meter and
    us per op. The minimum is the least disturbed by other processes; the median is shown beside it.
    """
    table = {}
    comparisons = [(kind, "plain", kind) for kind in METERS]
    comparisons.append(("installed_off", "before_install", "plain"))  # not rotated: two phases
    for label, base_name, kind in comparisons:
        for clock_index, clock in enumerate(("wall", "cpu")):
            for name, stat in (("min", min), ("median", statistics.median)):
                base = stat([t[clock_index] for t in times[base_name]])
                with_meter = stat([t[clock_index] for t in times[kind]])
                table[f"{label}_{clock}_{name}"] = {
                    "meter": label,
                    "plain_step_ms": base * 1e3,
                    "metered_step_ms": with_meter * 1e3,
                    "ratio": with_meter / base,
                    "overhead_us_per_op": (with_meter - base) / ops * 1e6,
                }
    return table


def machine():
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


# (name, batch size, choices, sequence length, rounds). The dispatch-bound workload has
# ops so small that the step is almost all per-op Python: it bounds the meter's cost per op.
WORKLOADS = (
    ("quickstart-4x4x64", 4, 4, 64, 20),
    ("quickstart-4x4x128", 4, 4, 128, 15),
    ("dispatch-bound-1x2x8", 1, 2, 8, 200),
)


def run_workload(name, batch_size, choices, seq_len, rounds):
    """Time one workload; returns its JSON row."""
    model, optimizer, batch = build(seq_len, batch_size, choices)
    train_step = make_step(model, optimizer, batch)
    train_step()  # creates the optimizer state, as every later step finds it
    ops = count_ops(train_step)
    times, peak_bytes = measure(train_step, model, optimizer, batch, rounds)
    return {
        "workload": name,
        "model": "recipes/quickstart.yaml (tiny BERT multiple choice)",
        "batch": [batch_size, choices, seq_len],
        "rounds": rounds,
        "ops_per_step": ops,
        "peak_bytes": peak_bytes,
        "timings": summarize(times, ops),
    }


def print_row(row):
    print(f"\n{row['workload']}: {row['ops_per_step']} ops/step, {row['rounds']} rounds")
    print(f"peak bytes: {row['peak_bytes']}")
    print(f"{'':<24}{'plain ms':>10}{'meter ms':>10}{'ratio':>8}{'us/op':>8}")
    for name, t in row["timings"].items():
        print(f"{name:<24}{t['plain_step_ms']:>10.1f}{t['metered_step_ms']:>10.1f}"
              f"{t['ratio']:>8.3f}{t['overhead_us_per_op']:>8.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--round-scale", type=float, default=1.0, help="multiply every workload's rounds"
    )
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one workload, in a child process
    args = parser.parse_args()
    if args.only:
        name, batch_size, choices, seq_len, rounds = next(w for w in WORKLOADS if w[0] == args.only)
        row = run_workload(name, batch_size, choices, seq_len, max(3, int(rounds * args.round_scale)))
        print(json.dumps(row))
        return

    rows = []
    for workload in WORKLOADS:
        # A fresh process per workload: the allocator, once installed, stays for the process.
        child = subprocess.run([sys.executable, __file__, "--only", workload[0], "--round-scale",
                                str(args.round_scale)], capture_output=True, text=True, check=True)
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print_row(rows[-1])
    result = {"workloads": rows, "machine": machine()}
    info = result["machine"]
    print(f"\n{info['cpu_count']} CPUs, {info['torch_threads']} torch threads, "
          f"torch {info['torch']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
