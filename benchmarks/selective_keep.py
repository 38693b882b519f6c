"""What a selective checkpoint saves when it keeps only the compute-heavy outputs its recompute
takes back (``PlanRunner.selective_keep``, counted by Mimose's probes) against keeping every one
(torch's selective checkpointing with a plain "save the matmuls" policy).

Non-reentrant checkpointing stops recomputing once the last saved tensor is packed again — for a
matmul, its input, before it runs — so a pre-norm layer's last matmul (ViT's output dense,
Llama's ``down_proj``) is never rerun, and an output kept for it only stays cached until the
layer's backward is over. Per model of the robustness matrix (random init, 4 blocks, hidden 64;
one batch at its largest size, fp32, simulated device): the step peak with every block kept
(``none``), every block checkpointed selectively keeping every heavy output and keeping only the
ones taken back, and every block recomputed (``full``); and the share of full recomputation's
memory saving that selective gets, (none - selective) / (none - full). Memory is exact; no times.
Writes benchmarks/results/selective_keep.json.

    PYTHONPATH=. python benchmarks/selective_keep.py [--models vit,llama,gpt2,bert]
"""

import argparse

import torch
from robustness import MODELS, SETTINGS, Shape, build_model, make_batch, make_step_fn

from mimose_cli.memory import build_meter
from mimose_cli.planners import build_planner
from mimose_cli.planners.blocks import KEEP, RECOMPUTE, SELECTIVE
from mimose_cli.planners.inputs import infer_input_size
from mimose_cli.planners.trial import probe_with_plan

from _results import write_results

LARGEST = {"vit": 96}  # px; the text models' longest sequence otherwise
CHOOSABLE = ("vit", "llama", "gpt2", "bert", "roberta", "xlnet")
"""The robustness models this measures: not T5 (its batches need targets) nor ResNet (its blocks'
BatchNorm statistics cannot be checkpointed selectively)."""
LENGTH, ROWS = 256, 4


def measure(name: str) -> dict:
    spec = MODELS[name]
    side = LARGEST.get(name, LENGTH)
    model = build_model(spec)
    meter = build_meter("simulated", 10**10)
    with meter.activate():
        meter.track(model)
        planner = build_planner("mimose", model, 10**10, meter=meter, choices="selective")
        try:
            step_fn = make_step_fn(model, spec, SETTINGS["fp32"], None)
            batch = make_batch(spec, Shape(lengths=(side,) * ROWS, padded=side), 0)
            planner.prepare(lambda size: make_batch(spec, Shape(lengths=(size[-1],) * size[0], padded=size[-1]), 0),
                            infer_input_size(batch), step_fn=step_fn)
            n = planner.num_blocks
            keep = dict(planner.parts.plan_runner.selective_keep)
            peaks = {"none": probe_with_plan(planner.parts, batch, (KEEP,) * n, step_fn=step_fn),
                     "full": probe_with_plan(planner.parts, batch, (RECOMPUTE,) * n, step_fn=step_fn),
                     "selective_taken_back": probe_with_plan(planner.parts, batch, (SELECTIVE,) * n, step_fn=step_fn)}
            planner.parts.plan_runner.selective_keep = {}
            peaks["selective_every_heavy"] = probe_with_plan(planner.parts, batch, (SELECTIVE,) * n, step_fn=step_fn)
        finally:
            planner.close()
    saving = peaks["none"] - peaks["full"]
    return {"model": name, "keep_per_block": sorted(set(keep.values())), **{f"{k}_bytes": v for k, v in peaks.items()},
            "share_every_heavy": (peaks["none"] - peaks["selective_every_heavy"]) / saving,
            "share_taken_back": (peaks["none"] - peaks["selective_taken_back"]) / saving}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vit,llama,gpt2,bert",
                        help="comma-separated, from " + ",".join(CHOOSABLE))
    args = parser.parse_args()
    unknown = [m for m in args.models.split(",") if m not in CHOOSABLE]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; from {','.join(CHOOSABLE)}")
    torch.set_num_threads(1)
    rows = [measure(name) for name in args.models.split(",")]
    print(f"{'model':11} {'none MiB':>9} {'sel. every':>10} {'sel. taken':>10} {'full MiB':>9} "
          f"{'share every':>11} {'share taken':>11}")
    for r in rows:
        print(f"{r['model']:11} {r['none_bytes'] / 2**20:9.2f} {r['selective_every_heavy_bytes'] / 2**20:10.2f} "
              f"{r['selective_taken_back_bytes'] / 2**20:10.2f} {r['full_bytes'] / 2**20:9.2f} "
              f"{r['share_every_heavy']:11.3f} {r['share_taken_back']:11.3f}")
    write_results("selective_keep", rows)


if __name__ == "__main__":
    main()
