"""How well Mimose's time model predicts what recomputing a block costs at sizes far beyond its
probes: ``ChoiceTimes`` (each block's ops' work read as a polynomial of the size, at rates timed
on ops as large as the largest batch's) and the fit it replaced (``a + c·B·L`` through the two
probes' timings, rebuilt here from the same probes), against the oracle's measurement at each size.

The robustness matrix's BERT (4 layers, hidden 64), eager and fused (sdpa) attention, padded
batches of 8 rows, Mimose planned for 384 tokens (``choices: selective``); at 64, 192 and 384
tokens the oracle (``choices: selective``) measures each block's heavy and light ops' time and
both models predict it. One thread, simulated device. Per size: the mean over blocks of the
recompute and the selective time, and each prediction / the measurement.
Writes benchmarks/results/choice_times.json.

    PYTHONPATH=. python benchmarks/choice_times.py [--lengths 64,192,384] [--rounds 3]
"""

import argparse
import dataclasses
import math
import statistics

import numpy as np
import torch
from robustness import MODELS, Shape, build_model, make_batch

from mimose_cli.memory import build_meter
from mimose_cli.planners import Mimose, Oracle
from mimose_cli.planners.mimose.choices import ChoiceTimes
from mimose_cli.planners.mimose.features import TOKENS

from _results import write_results

ROWS, LONGEST = 8, 384


def make(size):
    """A batch of ``size`` padded to its longest row (the last row one token shorter)."""
    rows, length = size
    return make_batch(MODELS["bert"], Shape(lengths=(length,) * (rows - 1) + (length - 1,), padded=length), 0)


def linear_fit(raws, sizes, stand_in, times: ChoiceTimes):
    """The time model before: each block's heavy and light ms fitted ``a + c·B·L`` through the two
    probes, plus the same per-op costs; returns ``at(B·L) -> (recompute, selective)``."""
    n = len(times.heavy)
    units = [math.prod(size) for size in sizes]
    fits = {}
    for quantity in ("heavy_ms", "light_ms"):
        v = np.array([raw.op_ms[quantity] for raw in raws], dtype=float)
        for i in range(n):
            if np.isnan(v[:, i]).any():
                v[:, i] = v[:, stand_in.get(i, i)]
        slope = (v[1] - v[0]) / (units[1] - units[0])
        fits[quantity] = (v[0] - slope * units[0], slope)

    def at(u):
        heavy, light = (np.maximum(a + c * u, 0.0) for a, c in (fits["heavy_ms"], fits["light_ms"]))
        ops = times.heavy_ops + times.light_ops
        return (heavy + light + ops * times.meter_ms,
                light + times.light_ops * times.meter_ms + 2 * ops * times.mode_ms)
    return at


def one_round(attention: str, lengths: list) -> list:
    spec = MODELS["bert"]
    model = build_model(dataclasses.replace(spec, config={**spec.config, "attn_implementation": attention,
                                                          "max_position_embeddings": 512}))
    meter = build_meter("simulated", 10**11)
    caught = {}
    from_probes = ChoiceTimes.from_probes.__func__

    def spy(cls, raws, sizes, feature_set, stand_in, *args, **kwargs):
        caught.setdefault("probes", (raws, sizes, stand_in))
        return from_probes(cls, raws, sizes, feature_set, stand_in, *args, **kwargs)

    ChoiceTimes.from_probes = classmethod(spy)
    try:
        with meter.activate():
            meter.track(model)
            with Mimose(model, "100GB", meter=meter, choices="selective") as planner:
                planner.prepare(make, (ROWS, LONGEST))
                times = planner.policy.choice_times
            before = linear_fit(*caught["probes"], times)
            rows = []
            with Oracle(model, "100GB", meter=meter, choices="selective") as oracle:
                oracle.prepare(make, (ROWS, LONGEST))
                for length in lengths:
                    size = (ROWS, length)
                    oracle.policy.measure(size)
                    measured = [t.mean() for t in oracle.policy.choice_ms[size]]
                    now = [t.mean() for t in times.at(TOKENS.of(size))]
                    old = [t.mean() for t in before(math.prod(size))]
                    rows.append({"attention": attention, "tokens": length, "measured_recompute_ms": measured[0],
                                 "measured_selective_ms": measured[1], "now_recompute_ms": now[0],
                                 "now_selective_ms": now[1], "before_recompute_ms": old[0],
                                 "before_selective_ms": old[1]})
    finally:
        ChoiceTimes.from_probes = classmethod(from_probes)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,192,384")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = [int(x) for x in args.lengths.split(",")]
    runs = [one_round(attention, lengths) for _ in range(args.rounds) for attention in ("eager", "sdpa")]
    keys = ("measured_recompute_ms", "measured_selective_ms", "now_recompute_ms", "now_selective_ms",
            "before_recompute_ms", "before_selective_ms")
    rows = []
    for attention in ("eager", "sdpa"):
        for length in lengths:
            cells = [r for run in runs for r in run if r["attention"] == attention and r["tokens"] == length]
            row = {"attention": attention, "tokens": length, "rounds": len(cells)}
            row.update({k: statistics.median(c[k] for c in cells) for k in keys})
            for model in ("now", "before"):
                for choice in ("recompute", "selective"):
                    ratios = [c[f"{model}_{choice}_ms"] / c[f"measured_{choice}_ms"] for c in cells]
                    row[f"{model}_{choice}_ratio"] = statistics.median(ratios)
                    row[f"{model}_{choice}_ratio_range"] = [min(ratios), max(ratios)]
            rows.append(row)
    print(f"{'attention':9} {'tokens':>6} {'measured rec ms':>15} {'now / measured':>15} {'before / measured':>18} "
          f"{'sel: now':>9} {'before':>7}")
    for r in rows:
        print(f"{r['attention']:9} {r['tokens']:>6} {r['measured_recompute_ms']:>15.2f} "
              f"{r['now_recompute_ratio']:>15.2f} {r['before_recompute_ratio']:>18.2f} "
              f"{r['now_selective_ratio']:>9.2f} {r['before_selective_ratio']:>7.2f}")
    write_results("choice_times", rows, rows_per_batch=ROWS, planned_for=[ROWS, LONGEST], rounds=args.rounds)


if __name__ == "__main__":
    main()
