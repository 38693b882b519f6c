"""Does the simulated meter's peak equal an independent count?

Two references, each with and without every block checkpointed (non-reentrant):
  - a stack of MLP blocks whose peak is derived by hand (see ``stack_reference``);
  - a tiny BERT multiple-choice training step (forward, backward, AdamW) measured by
    ``torch.distributed._tools.mem_tracker.MemTracker``, a separate implementation that
    tracks modules, parameters, grads and optimizer state by hooks.
Prints a table and writes benchmarks/results/meter_exactness.json.

    python benchmarks/meter_exactness.py
"""

import json
import platform
import warnings
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint
from transformers import BertConfig, BertForMultipleChoice

from mimose_cli.memory import build_meter
from mimose_cli.units import format_bytes

RESULTS = Path(__file__).parent / "results" / "meter_exactness.json"
N, B, D, H = 8, 2048, 256, 1024  # MLP blocks Linear(D, H) -> ReLU -> Linear(H, D)
F32 = 4


def stack_reference(ckpt):
    """Hand-derived peak of forward + backward of the MLP stack (reached in the last block's
    ReLU backward): weights, every block input, every ReLU output unless checkpointed, the
    loss and ones(), the grads of that ReLU's output and input, the second weight's grad,
    and with checkpointing the recomputed ReLU output of that block."""
    act_d, act_h = B * D * F32, B * H * F32
    weights = N * 2 * D * H * F32
    held = weights + N * act_d + (0 if ckpt else N * act_h)
    return held + 2 * F32 + 2 * act_h + D * H * F32 + (act_h if ckpt else 0)


def stack_meter_peak(ckpt):
    """The simulated meter's peak for the same forward + backward."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(
        torch.nn.Sequential(
            torch.nn.Linear(D, H, bias=False), torch.nn.ReLU(), torch.nn.Linear(H, D, bias=False)
        )
        for _ in range(N)
    )
    meter = build_meter("simulated")
    with meter.activate():
        meter.track(blocks)
        x = torch.randn(B, D)
        with meter.step() as mem:
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=False) if ckpt else block(x)
            loss = x.sum()
            del x
            loss.backward()
    return mem.peak_bytes


def bert_step(ckpt):
    """A tiny BERT multiple-choice training step, with its optimizer state already created."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=128,
    )
    model = BertForMultipleChoice(config).train()
    if ckpt:
        for layer in model.bert.encoder.layer:
            layer.forward = _checkpointed(layer.forward)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    batch = {
        "input_ids": torch.randint(0, 1000, (8, 4, 128)),
        "attention_mask": torch.ones(8, 4, 128, dtype=torch.long),
        "labels": torch.randint(0, 4, (8,)),
    }

    def train_step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()
    return train_step, (model, optimizer, batch)


def _checkpointed(forward):
    return lambda *args, **kwargs: checkpoint(forward, *args, use_reentrant=False, **kwargs)


def bert_peaks(ckpt):
    """(simulated meter peak, MemTracker peak) of the same BERT step."""
    train_step, (model, optimizer, batch) = bert_step(ckpt)
    meter = build_meter("simulated")
    with meter.activate():
        meter.track(model, optimizer, batch)
        with meter.step() as mem:
            train_step()
    reference = MemTracker()
    reference.track_external(model, optimizer, *batch.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker warns about hooks of freed modules
        with reference:
            train_step()
    return mem.peak_bytes, reference.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def main():
    rows = []
    for ckpt in (False, True):
        stack = (stack_meter_peak(ckpt), stack_reference(ckpt))
        rows.append(("mlp-stack", ckpt, "hand-derived", *stack))
        rows.append(("bert-8x4x128", ckpt, "MemTracker", *bert_peaks(ckpt)))
    records = [
        {
            "workload": workload, "checkpointed": ckpt, "reference": ref_name,
            "meter_peak_bytes": meter_peak, "reference_peak_bytes": ref_peak,
            "error_pct": 100 * (meter_peak - ref_peak) / ref_peak,
        }
        for workload, ckpt, ref_name, meter_peak, ref_peak in rows
    ]
    print(f"{'workload':<14}{'ckpt':<6}{'reference':<14}"
          f"{'meter peak':>12}{'ref peak':>12}{'error %':>9}")
    for r in records:
        meter_peak, ref_peak = r["meter_peak_bytes"], r["reference_peak_bytes"]
        print(f"{r['workload']:<14}{str(r['checkpointed']):<6}{r['reference']:<14}"
              f"{format_bytes(meter_peak):>12}{format_bytes(ref_peak):>12}{r['error_pct']:>9.4f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    info = {"platform": platform.platform(), "torch": torch.__version__}
    RESULTS.write_text(json.dumps({"rows": records, "machine": info}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
