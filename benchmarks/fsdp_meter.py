"""Does the simulated device count what FSDP2 holds? Its per-rank peak against torch's own
``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``), a separate implementation
that follows FSDP's sharded and unsharded parameters, gradients and all-gather buffers by hooks.

Two gloo ranks (torch.multiprocessing), a tiny BERT from config with ``fully_shard`` on each layer
and on the root, AdamW; each rank its own sequence length. For every block kept and every block
checkpointed (non-reentrant, through the "full" planner's router), one training step (forward,
backward, optimizer step) measured by each: the meter's peak live bytes and the tracker's peak
total, both absolute (weights, optimizer state and batch included). Then Mimose's predicted step
peak against the meter's, each rank at its own lengths, at a budget that makes rank 1 checkpoint.
Prints the tables and writes benchmarks/results/fsdp_meter.json.

    python benchmarks/fsdp_meter.py
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import BertConfig, BertForSequenceClassification

sys.path.insert(0, os.path.dirname(__file__))
from _results import write_results  # noqa: E402

from mimose_cli.memory import build_meter  # noqa: E402
from mimose_cli.planners import Mimose, build_planner  # noqa: E402
from mimose_cli.planners.blocks import checkpointed  # noqa: E402
from mimose_cli.units import format_bytes  # noqa: E402

WORLD, BATCH, LENGTHS = 2, 4, (96, 160)  # rank r trains at LENGTHS[r]
PLANNED = ((32, 64, 96, 48), (128, 192, 160, 224))  # rank r's lengths under Mimose
BUDGET = 16 * 2**20


def _model():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=256, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def _batch(length: int, rank: int) -> dict:
    generator = torch.Generator().manual_seed(rank)
    # No attention mask: rows of one length (a mask of ones would take the model's masked path,
    # for which Mimose's probes pad a row and over-predict by up to 15 % with or without FSDP).
    return {"input_ids": torch.randint(0, 512, (BATCH, length), generator=generator),
            "labels": torch.randint(0, 2, (BATCH,), generator=generator)}


def _step(model, optimizer, batch, planner) -> None:
    with planner.step(batch):
        model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _measure(rank: int, store_path: str, queue) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, store=dist.FileStore(store_path, WORLD))
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batch(LENGTHS[rank], rank)
    rows = []
    for plan in ("none", "full"):
        planner = build_planner(plan, model)
        _step(model, optimizer, batch, planner)  # the optimizer's state exists from here on
        meter = build_meter("simulated", None)
        with meter.activate():
            meter.track(model, optimizer, batch)
            with meter.step() as mem:
                _step(model, optimizer, batch, planner)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((batch,))
        with tracker:
            _step(model, optimizer, batch, planner)
        tracked = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        planner.close()
        rows.append({"rank": rank, "length": LENGTHS[rank], "plan": plan, "meter_peak_bytes": mem.peak_bytes,
                     "tracker_peak_bytes": tracked, "difference_bytes": mem.peak_bytes - tracked})
    queue.put((rows, _planned(rank, model, optimizer)))
    dist.destroy_process_group()


def _planned(rank: int, model, optimizer) -> list:
    """Mimose's prediction against the meter's peak, step by step, at ``BUDGET``."""
    rows = []
    meter = build_meter("simulated", BUDGET)
    with meter.activate(), Mimose(model, BUDGET, meter=meter) as planner:
        meter.track(model)
        planner.track(optimizer)
        for length in PLANNED[rank]:
            batch = _batch(length, rank)
            meter.track(batch)
            with meter.step() as mem:
                with planner.step(batch) as info:
                    model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rows.append({"rank": rank, "length": length, "checkpointed": len(checkpointed(info.plan)),
                         "predicted_bytes": info.predicted_peak_bytes, "meter_peak_bytes": mem.peak_bytes,
                         "error": info.predicted_peak_bytes / mem.peak_bytes - 1,
                         "estimate": planner.stats["estimate_source"]})
    return rows


def main() -> None:
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        procs = [context.Process(target=_measure, args=(rank, store, queue)) for rank in range(WORLD)]
        for proc in procs:
            proc.start()
        got = [queue.get(timeout=300) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
    rows = sorted((row for meters, _ in got for row in meters), key=lambda r: (r["rank"], r["plan"]))
    planned = sorted((row for _, steps in got for row in steps), key=lambda r: r["rank"])
    print(f"{'rank':>4} {'length':>6} {'plan':>5} {'meter peak':>12} {'FSDPMemTracker':>15} {'difference':>11}")
    for r in rows:
        print(f"{r['rank']:>4} {r['length']:>6} {r['plan']:>5} {format_bytes(r['meter_peak_bytes']):>12} "
              f"{format_bytes(r['tracker_peak_bytes']):>15} {r['difference_bytes']:>+11,d} B")
    print(f"\nMimose at {format_bytes(BUDGET)} a rank: predicted step peak against the meter's")
    print(f"{'rank':>4} {'length':>6} {'checkpointed':>12} {'predicted':>10} {'meter peak':>10} {'error':>7} estimate")
    for r in planned:
        print(f"{r['rank']:>4} {r['length']:>6} {r['checkpointed']:>12} {format_bytes(r['predicted_bytes']):>10} "
              f"{format_bytes(r['meter_peak_bytes']):>10} {100 * r['error']:>+6.2f}% {r['estimate']}")
    write_results("fsdp_meter", rows, planned=planned, world_size=WORLD, batch=BATCH, lengths=list(LENGTHS),
                  planned_lengths=[list(p) for p in PLANNED], budget_bytes=BUDGET,
                  model="BERT 4 layers, hidden 64, fully_shard per layer and root, AdamW")


if __name__ == "__main__":
    main()
