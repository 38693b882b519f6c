"""Is Mimose's first planned step already well predicted? (issue: Plan from the first step)

For each tiny model of the robustness matrix (4 blocks, hidden 64), on the simulated device and
one thread: Mimose (``estimate="probes"``, the default) is given the first batch of a run and,
before that step runs, takes its two probe steps and fits its estimator from them (no training
step measured). Then, at held-out sizes with padding (rows of different lengths; other batch
sizes and lengths than the probes'), every block plan of interest (none, every block, every
other block) is predicted and run once, unseen by training (``trial.probe_with_plan``), and the
prediction (margins included, as the scheduler uses it) compared with the measured step peak:
``error = (predicted - measured) / measured``; and ``vs sample``: how far the estimate is from a
sample measured at that size as the sheltered phase measures one (0: the scaling is exact, so
what error remains is the step timeline's own upper bounds, the same for measured samples).
Also the probes' cost in ordinary steps of the first batch's size, how many probe steps ran, and
how many blocks they took from an earlier block alike in parameters instead of measuring their
plain run (``alike``), and how many let go of an input when run plainly (``releases``, seen by the
plain probe step), and how many layers of a stack they left out (``left out``: a layer before them alike stands
for them). ``--layers 8`` gives every model stacks of 8 layers (T5: 8 in each stack), where the
probes leave layers out; the matrix's 4 leave none. ``--precision bf16`` (or fp16, with a GradScaler) runs the probes and every
measured step under that autocast, as the robustness matrix's settings do. Writes
benchmarks/results/first_step.json (first_step_bf16.json, ...).

    python benchmarks/first_step.py [--models bert,gpt2] [--precision bf16] [--layers 8]
"""

import argparse
import dataclasses
import time

import numpy as np
import torch
from robustness import MODELS, SETTINGS, Shape, build_model, make_batch, make_step_fn

from mimose_cli.memory import build_meter
from mimose_cli.planners.base import build_planner
from mimose_cli.planners.blocks import recomputed
from mimose_cli.planners.mimose.policy import Mimose
from mimose_cli.planners.trial import probe_step, probe_with_plan

from _results import write_results

FIRST = (4, 96)
HELD_OUT = ((4, 40), (4, 160), (2, 200), (3, 33), (6, 64))
"""(batch, padded length); the rows' lengths run from the padded length down to half of it."""


def _shape(spec, rows: int, length: int, step: int) -> Shape:
    if spec.kind == "image":
        return Shape(lengths=(32,) * rows, padded=32)  # the model's own image size
    lengths = tuple(int(length - (length // 2) * k // max(1, rows - 1)) for k in range(rows))
    if spec.kind == "seq2seq":
        targets = tuple(max(4, n // 3) for n in lengths)
        return Shape(lengths, length, targets, max(targets))
    return Shape(lengths, length)


def _sample_diff(planner, batch, size, step_fn=None) -> float:
    """The largest difference between the estimate at ``size`` and a sample measured there (a
    sheltered step's, unseen by training), over every quantity the timeline is built from, in
    percent of that sample's largest value: 0 when the probes' scaling is exact."""
    planner.policy.measurer.begin(inputs=batch)  # the batch is the step's start, as in the probes
    with planner.parts.router.using(planner.policy.measurer):
        probe_step(planner.parts, batch, step_fn)
    blocks, step, _ = planner.policy.measurer.end()
    predicted = planner.policy.estimator.predict(size)
    pairs = [(predicted.blocks[q][i], v.max()) for q, per in blocks.items() if q not in ("fwd_ms", "saved_bytes")
             for i, v in enumerate(per) if v is not None and len(v)]
    pairs += [(predicted.step[q], v.max()) for q, v in step.items() if v is not None and len(v)]
    scale = max(abs(m) for _, m in pairs)
    return max(abs(p - m) for p, m in pairs) / scale * 100


LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers")


def deeper(spec, layers: int | None):
    """``spec`` with stacks of ``layers`` layers (every layer count its config has), or as it is."""
    if not layers:
        return spec
    config = {k: (layers if k in LAYER_KEYS else v) for k, v in spec.config.items()}
    return dataclasses.replace(spec, config=config)


def measure(name: str, precision: str = "fp32", layers: int | None = None) -> dict:
    spec = deeper(MODELS[name], layers)
    model = build_model(spec).train()
    meter = build_meter("simulated", 10**11)
    setting = SETTINGS[precision]
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    step_fn = make_step_fn(model, spec, setting, scaler)
    row = {"model": name, "precision": precision, "cases": []}
    with meter.activate():
        meter.track(model)
        first = make_batch(spec, _shape(spec, *FIRST, 0), 0)
        plain = build_planner("none", model, None, meter=meter)
        with plain.parts.router.using(plain.parts.plan_runner):
            probe_step(plain.parts, first, step_fn)  # warm-up: the first ops a process runs are slow
            start = time.perf_counter()
            for _ in range(3):
                probe_step(plain.parts, first, step_fn)
            plain_ms = (time.perf_counter() - start) * 1e3 / 3
        plain.close()
        planner = Mimose(model, "100GB", meter=meter)
        planner.run(step_fn, first)  # the probes run before this step is planned
        for p in model.parameters():
            p.grad = None
        stats = planner.stats
        row.update(source=stats["estimate_source"], fallback=stats["estimate_fallback"],
                   first_phase=planner.last.phase, probe_ms=stats["probe_ms"], plain_ms=plain_ms,
                   probe_in_plain=stats["probe_ms"] / plain_ms, probe_steps=stats["probe_steps"],
                   probe_twins=stats["probe_twins"], probe_releases=stats["probe_releases"],
                   probe_skipped=stats["probe_skipped"], probe_skips_refused=stats["probe_skips_refused"],
                   blocks=planner.num_blocks)
        n = planner.num_blocks
        plans = {"none": recomputed((), n), "all": recomputed(range(n), n), "every other": recomputed(range(0, n, 2), n)}
        for step, (rows, length) in enumerate(HELD_OUT, start=1):
            batch = make_batch(spec, _shape(spec, rows, length, step), step)
            from mimose_cli.planners.inputs import infer_input_size
            size = infer_input_size(batch, planner.parts.encoder_decoder)
            row.setdefault("sample_diff_pct", 0.0)
            row["sample_diff_pct"] = max(row["sample_diff_pct"], _sample_diff(planner, batch, size, step_fn))
            for label, plan in plans.items():
                predicted = planner.predict_peak(size, plan)
                measured = probe_with_plan(planner.parts, batch, plan, step_fn)
                error = None if predicted is None else (predicted - measured) / measured * 100
                row["cases"].append({"size": list(size), "plan": label, "predicted": predicted,
                                     "measured": measured, "error_pct": error})
        planner.close()
    errors = [c["error_pct"] for c in row["cases"] if c["error_pct"] is not None]
    row["untrusted"] = sum(c["error_pct"] is None for c in row["cases"])
    row["max_over_pct"] = max(errors, default=None)
    row["max_under_pct"] = min(errors, default=None)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,roberta,xlnet,gpt2,llama,t5-nocache,vit")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--layers", type=int, default=None, help="layers in each stack (default: the matrix's 4)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    np.seterr(all="ignore")
    rows = []
    print(f"{'model':11} {'source':8} {'probes/plain':>12} {'steps':>5} {'alike':>7} {'lets go':>7} {'left out':>8} {'cases':>5} {'untrusted':>9} "
          f"{'max over %':>10} {'max under %':>11} {'vs sample %':>11}  fallback")
    for name in args.models.split(","):
        row = measure(name, args.precision, args.layers)
        rows.append(row)
        over = "-" if row["max_over_pct"] is None else f"{row['max_over_pct']:+.3f}"
        under = "-" if row["max_under_pct"] is None else f"{row['max_under_pct']:+.3f}"
        print(f"{name:11} {row['source']:8} {row['probe_in_plain']:11.2f}x {row['probe_steps']:5} "
              f"{row['probe_twins']:>3}/{row['blocks']:<3} {row['probe_releases']:7} {row['probe_skipped']:8} {len(row['cases']):5} "
              f"{row['untrusted']:9} {over:>10} {under:>11} {row.get('sample_diff_pct', 0):11.2g}  "
              f"{row['fallback']} {row['probe_skips_refused']}",
              flush=True)
    name = "first_step" if args.precision == "fp32" else f"first_step_{args.precision}"
    name += f"_{args.layers}_layers" if args.layers else ""
    write_results(name, rows, first=list(FIRST), held_out=[list(s) for s in HELD_OUT], precision=args.precision,
                  layers=args.layers, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
