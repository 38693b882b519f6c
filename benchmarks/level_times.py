"""What each level of a finer plan costs when every block takes it, measured, against what Mimose's
time model (``ChoiceTimes``) predicts: keep, selective, the partial levels
(``features.PARTIAL_LEVELS``: a selective checkpoint keeping only the first heavy ops' outputs)
and a whole recompute.

Per model (the robustness matrix's tiny models, 4 layers of hidden 64, and ``bert-base-width``, 4
BERT layers of hidden 768), Mimose (``choices: selective``) probes for padded batches of 8 rows up
to 256 tokens; then at 8 x 256 each plan (every block at one level) runs a training step,
``--rounds`` times with the plans' order rotated, the first round a warm-up. Per plan: the median
recompute ms of the step (the planner's recompute clock) and the model's prediction (the sum over
blocks), and the plan's step peak (simulated device). A partial level pays where it costs less
than the whole recompute; on this CPU a tiny model's op runs mostly Python, and a selective
checkpoint's dispatch mode costs per op (docs/MIMOSE.md, "Finer plans"), so it may not. One thread.
Writes benchmarks/results/<--out>.json (default ``level_times``).

    PYTHONPATH=. python benchmarks/level_times.py [--models bert,gpt2,bert-base-width] [--rounds 5] [--out NAME]
"""

import argparse
import statistics

import torch
from block_choices import measured_rows
from robustness import Shape, build_model, make_batch

from mimose_cli.memory import build_meter
from mimose_cli.planners import Mimose
from mimose_cli.planners.blocks import PARTIAL_LEVELS
from mimose_cli.planners.contract import Decision

from _results import write_results

ROWS, LENGTH = 8, 256
LEVELS = ("keep", "selective", *PARTIAL_LEVELS, "recompute")


def _decision(level: str, n: int) -> Decision:
    return Decision((level,) * n)


def measure(name: str, spec, rounds: int) -> dict:
    model = build_model(spec).train()

    def make(size):
        rows, length = size
        rows //= 2 if spec.kind == "choice" else 1  # a multiple-choice row is two sequences
        return make_batch(spec, Shape(lengths=(length,) * (rows - 1) + (length - 1,), padded=length), 0)

    batch = make((ROWS, LENGTH))
    meter = build_meter("simulated", 10**12)
    ms = {level: [] for level in LEVELS}
    peaks = {}
    with meter.activate():
        meter.track(model)
        meter.track(batch)
        with Mimose(model, "100GB", meter=meter, choices="selective") as planner:
            planner.prepare(make, (ROWS, LENGTH))
            policy, n = planner.policy, planner.num_blocks
            keep = planner.parts.plan_runner.partial_keep
            levels = [level for level in LEVELS if level not in PARTIAL_LEVELS
                      or all(level in keep.get(i, {}) for i in range(n))]
            for round_ in range(rounds + 1):
                order = levels[round_ % len(levels):] + levels[:round_ % len(levels)]
                for level in order:
                    # The plan under test, whatever the budget would choose (a benchmark's fixed plan).
                    policy.decide = lambda size, context=None, decided=_decision(level, n): decided
                    for p in model.parameters():
                        p.grad = None
                    with meter.step() as mem:
                        with planner.step(batch) as info:
                            model(**batch).loss.backward()
                    peaks[level] = mem.peak_bytes - mem.start_bytes
                    if round_:  # the first round warms up
                        ms[level].append(info.recompute_ms)
            times = policy.choice_times
            if times is None:
                return {"model": name, "error": "the probes gave no time model (see the warning above)"}
            features = policy.estimator.feature_set.of(policy.cache_key((ROWS, LENGTH)))
            recompute, selective = times.at(features)
            partial = times.partial_at(features, selective)
    predicted = {"keep": 0.0, "selective": float(selective.sum()), "recompute": float(recompute.sum())}
    if partial is not None:
        predicted.update({level: float(partial[:, k].sum()) for k, level in enumerate(PARTIAL_LEVELS)})
    measured = {level: statistics.median(v) for level, v in ms.items() if v}
    return {"model": name, "blocks": n, "kept_ops": {level: keep.get(0, {}).get(level) for level in PARTIAL_LEVELS},
            "measured_ms": measured, "predicted_ms": {k: predicted.get(k) for k in measured},
            "peak_bytes": peaks, "rounds_ms": ms}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,roberta,gpt2,llama,bert-base-width")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="level_times", help="benchmarks/results/<out>.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    head = "".join(f"{level:>20}" for level in LEVELS[1:])
    print(f"{'model':16}{head}   (recompute ms measured / predicted; peak MB)")
    rows, measured = measured_rows(args.models, args.rounds, measure)
    for name, row in measured:
        cells = []
        for level in LEVELS[1:]:
            got, model = row["measured_ms"].get(level), row["predicted_ms"].get(level)
            peak = row["peak_bytes"].get(level)
            cells.append("-" if got is None else f"{got:.1f}/{model:.1f} {peak / 2**20:.0f}MB")
        print(f"{name:16}" + "".join(f"{c:>20}" for c in cells), flush=True)
    write_results(args.out, rows, rows_per_batch=ROWS, length=LENGTH, rounds=args.rounds,
                  threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
