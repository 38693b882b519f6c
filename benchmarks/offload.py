"""What offloading every block holds and costs, beside keeping and recomputing (issue: Finer plans).

For tiny models of the robustness matrix (random init, 4 blocks, hidden 64), on the simulated
device and one thread, one batch (4 rows, padded length 256; images 96 px; T5 targets 86): the
step's device peak above its start, exact bytes, with every block kept (planner ``none``), every
block offloaded (planner ``offload``: what autograd saves inside a block in host memory until
backward) and every block recomputed (``full``); the host bytes the offloaded copies held at
their peak; the transfer time those bytes would take, MODELLED as two copies at
``memory.offload.HOST_LINK_GB_PER_S`` (no GPU measured it); and the step time MEASURED on this
CPU, the planners in rotated order for ``--rounds`` rounds, the median of each. On the CPU host
and device are one memory, so the measured offload step pays a memcpy per saved storage, not a
PCIe transfer. Writes benchmarks/results/offload.json.

    python benchmarks/offload.py [--models bert,gpt2] [--rounds 3]
"""

import argparse
import statistics
import time

import torch
from block_choices import _shape
from robustness import MODELS, build_model, make_batch

from mimose_cli.memory import build_meter
from mimose_cli.memory.offload import HOST_LINK_GB_PER_S, offload_ms
from mimose_cli.planners.base import build_planner

from _results import write_results

PLANS = {"keep": "none", "offload": "offload", "recompute": "full"}


def _run(plan: str, model, batch, extra: dict, meter) -> tuple:
    """One step of ``plan``: (device peak above the start, host peak, measured ms)."""
    planner = build_planner(PLANS[plan], model, None, meter=meter)
    for p in model.parameters():
        p.grad = None
    with meter.step() as mem:
        begin = time.perf_counter()
        with planner.step(batch):
            model(**batch, **extra).loss.backward()
        seconds = time.perf_counter() - begin
    planner.close()
    return mem.peak_bytes - mem.start_bytes, mem.peak_host_bytes, seconds * 1e3


def measure(name: str, rounds: int) -> dict:
    spec = MODELS[name]
    model = build_model(spec).train()
    batch = make_batch(spec, _shape(spec), 0)
    extra = {"interpolate_pos_encoding": True} if spec.config["model_type"] == "vit" else {}
    meter = build_meter("simulated", 10**12)
    peaks, host, times = {}, {}, {plan: [] for plan in PLANS}
    with meter.activate():
        meter.track(model, batch)
        for round_ in range(rounds + 1):
            order = list(PLANS)[round_ % 3:] + list(PLANS)[:round_ % 3]
            for plan in order:
                peaks[plan], host[plan], ms = _run(plan, model, batch, extra, meter)
                if round_:  # the first round warms up
                    times[plan].append(ms)
    ms = {plan: statistics.median(v) for plan, v in times.items()}
    return {"model": name, "peak_bytes": peaks, "offloaded_host_peak_bytes": host["offload"],
            "offload_saved_bytes": peaks["keep"] - peaks["offload"],
            "modelled_transfer_ms": offload_ms(host["offload"]), "measured_step_ms": ms}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,gpt2,llama,t5-nocache,vit,resnet")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'model':12} {'keep B':>10} {'offload B':>10} {'recompute B':>11} {'host B':>10} "
          f"{'transfer ms (modelled)':>22} {'keep/offload/recompute ms (measured)':>36}")
    for name in args.models.split(","):
        row = measure(name, args.rounds)
        rows.append(row)
        peak, ms = row["peak_bytes"], row["measured_step_ms"]
        print(f"{name:12} {peak['keep']:10d} {peak['offload']:10d} {peak['recompute']:11d} "
              f"{row['offloaded_host_peak_bytes']:10d} {row['modelled_transfer_ms']:22.3f} "
              f"{ms['keep']:12.1f} {ms['offload']:11.1f} {ms['recompute']:11.1f}", flush=True)
    write_results("offload", rows, rounds=args.rounds, threads=torch.get_num_threads(),
                  host_link_gb_per_s=HOST_LINK_GB_PER_S, transfer_time="modelled", step_time="measured on this CPU")


if __name__ == "__main__":
    main()
