"""How much slower a training step runs with the simulated meter on.

Times a tiny BERT multiple-choice step (forward, backward, AdamW) with and without the
simulated meter, interleaved in one run so the ratio is measured side by side, on the
recipe-sized batch and on a dispatch-bound one, and writes
benchmarks/results/meter_overhead.json. Wall and process-CPU times are both reported: on
a shared machine CPU time is the steadier of the two.

    python benchmarks/meter_overhead.py [--round-scale 1.0]
"""

import argparse
import json
import os
import platform
import statistics
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


def measure(train_step, model, optimizer, batch, rounds):
    """Step times without and with the meter, alternating so drift hits both alike."""
    meter = build_meter("simulated")
    plain, metered = [], []
    with meter.activate():
        meter.track(model, optimizer, batch)
        timed(train_step, meter)  # warm-up with the mode on
    timed(train_step)
    for _ in range(rounds):
        plain.append(timed(train_step))
        with meter.activate():
            metered.append(timed(train_step, meter))
    return plain, metered, meter.peak_bytes()


def summarize(plain, metered, ops):
    """Per clock (wall, CPU) and statistic (min, median): step ms, ratio and us per op.

    The minimum is the least disturbed by other processes; the median is shown beside it.
    """
    table = {}
    for clock_index, clock in enumerate(("wall", "cpu")):
        for name, stat in (("min", min), ("median", statistics.median)):
            base = stat([t[clock_index] for t in plain])
            with_meter = stat([t[clock_index] for t in metered])
            table[f"{clock}_{name}"] = {
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
    plain, metered, peak_bytes = measure(train_step, model, optimizer, batch, rounds)
    return {
        "workload": name,
        "model": "recipes/quickstart.yaml (tiny BERT multiple choice)",
        "batch": [batch_size, choices, seq_len],
        "rounds": rounds,
        "ops_per_step": ops,
        "peak_bytes": peak_bytes,
        "timings": summarize(plain, metered, ops),
    }


def print_row(row):
    print(f"\n{row['workload']}: {row['ops_per_step']} ops/step, {row['rounds']} rounds")
    print(f"{'':<12}{'plain ms':>10}{'meter ms':>10}{'ratio':>8}{'us/op':>8}")
    for name, t in row["timings"].items():
        print(f"{name:<12}{t['plain_step_ms']:>10.1f}{t['metered_step_ms']:>10.1f}"
              f"{t['ratio']:>8.3f}{t['overhead_us_per_op']:>8.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--round-scale", type=float, default=1.0, help="multiply every workload's rounds"
    )
    args = parser.parse_args()

    rows = []
    for name, batch_size, choices, seq_len, rounds in WORKLOADS:
        rounds = max(3, int(rounds * args.round_scale))
        rows.append(run_workload(name, batch_size, choices, seq_len, rounds))
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
