"""What each block choice holds and costs: keep, selective, recompute (issue: Finer plans).

For each tiny model of the robustness matrix (random init, 4 blocks, hidden 64) and for a
base-width BERT layer stack (hidden 768, 4 layers), on the simulated device and one thread, one
batch (4 rows, padded length 256; images 96 px; T5 targets 86): the step peak above the step's
start and the step time with every block kept (``none``), every block checkpointed selectively
(``full`` with ``selective``: the compute-heavy ops' outputs kept, ``blocks.COMPUTE_HEAVY_OPS``)
and every block recomputed (``full``), the planners in rotated order for ``--rounds`` rounds, the
median time of each. ``saved of keep's``: how much of what keeping every block holds beyond
recomputing every block a selective plan gives back ((keep - selective) / (keep - recompute)).
Times on this CPU are mostly Python per op for the tiny models; the base-width stack shows the
compute. Writes benchmarks/results/block_choices.json.

    python benchmarks/block_choices.py [--models bert,gpt2] [--rounds 3]
"""

import argparse
import statistics
import time

import torch
from robustness import MODELS, Shape, build_model, make_batch

from mimose_cli.memory import build_meter
from mimose_cli.planners.base import build_planner

from _results import write_results

PLANS = {"keep": ("none", {}), "selective": ("full", {"selective": True}), "recompute": ("full", {})}
LENGTH = 256


def _shape(spec) -> Shape:
    if spec.kind == "image":
        return Shape(lengths=(96,) * 4, padded=96)
    lengths = (LENGTH, LENGTH - 40, LENGTH - 80, LENGTH - 120)
    if spec.kind == "seq2seq":
        targets = tuple(n // 3 for n in lengths)
        return Shape(lengths, LENGTH, targets, max(targets))
    return Shape(lengths, LENGTH)


def _base_bert():
    from robustness import ModelSpec

    return ModelSpec("BertForSequenceClassification", "classify",
                     dict(model_type="bert", vocab_size=1000, hidden_size=768, num_hidden_layers=4,
                          num_attention_heads=12, intermediate_size=3072))


def measured_rows(names: str, rounds: int, measure):
    """``(name, row)`` of ``measure(name, spec, rounds)`` for each comma-separated model name (the
    robustness matrix's, or ``bert-base-width``), in order; a row with an ``error`` (the model
    cannot run the plans) is printed as not run and not yielded. Every row is appended to the
    list returned first, for the JSON."""
    rows = []

    def each():
        for name in names.split(","):
            row = measure(name, _base_bert() if name == "bert-base-width" else MODELS[name], rounds)
            rows.append(row)
            if "error" in row:
                print(f"{name:16} not run: {row['error']}", flush=True)
                continue
            yield name, row

    return rows, each()


def measure(name: str, spec, rounds: int) -> dict:
    model = build_model(spec).train()
    try:
        build_planner("full", model, None, selective=True).close()
    except ValueError as err:  # blocks with BatchNorm statistics: no selective run
        return {"model": name, "error": str(err)}
    batch = make_batch(spec, _shape(spec), 0)
    extra = {"interpolate_pos_encoding": True} if spec.config["model_type"] == "vit" else {}
    meter = build_meter("simulated", 10**12)
    peaks, times = {}, {plan: [] for plan in PLANS}
    with meter.activate():
        meter.track(model)
        meter.track(batch)
        for round_ in range(rounds + 1):
            order = list(PLANS)[round_ % 3:] + list(PLANS)[:round_ % 3]
            for plan in order:
                planner_name, options = PLANS[plan]
                planner = build_planner(planner_name, model, None, meter=meter, **options)
                for p in model.parameters():
                    p.grad = None
                with meter.step() as mem:
                    begin = time.perf_counter()
                    with planner.step(batch):
                        model(**batch, **extra).loss.backward()
                    seconds = time.perf_counter() - begin
                planner.close()
                peaks[plan] = mem.peak_bytes - mem.start_bytes
                if round_:  # the first round warms up
                    times[plan].append(seconds * 1e3)
    ms = {plan: statistics.median(v) for plan, v in times.items()}
    given_back = (peaks["keep"] - peaks["selective"]) / max(1, peaks["keep"] - peaks["recompute"])
    return {"model": name, "peak_bytes": peaks, "step_ms": ms, "selective_saved_of_keep": given_back,
            "selective_over_keep_ms": ms["selective"] / ms["keep"], "recompute_over_keep_ms": ms["recompute"] / ms["keep"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,roberta,xlnet,gpt2,llama,t5-nocache,vit,resnet,bert-base-width")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':16} {'keep MB':>8} {'selective MB':>12} {'recompute MB':>12} {'saved of keep':>13} "
          f"{'selective/keep ms':>17} {'recompute/keep ms':>17}")
    rows, measured = measured_rows(args.models, args.rounds, measure)
    for name, row in measured:
        mb = {k: v / 2**20 for k, v in row["peak_bytes"].items()}
        print(f"{name:16} {mb['keep']:8.1f} {mb['selective']:12.1f} {mb['recompute']:12.1f} "
              f"{row['selective_saved_of_keep']:13.2f} {row['selective_over_keep_ms']:17.3f} "
              f"{row['recompute_over_keep_ms']:17.3f}", flush=True)
    write_results("block_choices", rows, rounds=args.rounds, length=LENGTH, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
