"""What a partial level could recompute if it kept a block's dearest heavy outputs instead of the first.

A partial level (docs/MIMOSE.md, "Partial levels") keeps the outputs of a block's first
compute-heavy ops (``blocks.COMPUTE_HEAVY_OPS``) in forward order and recomputes the rest. This
times each heavy op of one base-width BERT layer (hidden 768, 12 heads, a batch of 8 × 256, one
thread, the fastest of ``--rounds`` forwards) with its output's bytes, and for a budget of 75, 50
and 25 % of those bytes compares the heavy ms a forward-order prefix recomputes with the least any
subset within the budget recomputes (every subset tried). The light ops are recomputed either way
and are left out; the bytes are the heavy outputs alone (what a selective checkpoint holds beyond
a whole one is those its recompute takes back: about these). A design question for the partial
levels, not a figure of Mimose's plans. Writes benchmarks/results/partial_order.json.

    python benchmarks/partial_order.py [--rounds 4]
"""

import argparse
import itertools
import time

import torch
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer

from mimose_cli.planners.ops import COMPUTE_HEAVY_OPS
from mimose_cli.torch_private import UncompiledDispatchMode, tree_leaves

from _results import write_results

FRACTIONS = (0.75, 0.5, 0.25)


class _HeavyTimer(UncompiledDispatchMode):
    """Each compute-heavy op's name, ms and output bytes, in forward order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        ms = (time.perf_counter() - start) * 1e3
        if func in COMPUTE_HEAVY_OPS:
            first = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.ops.append((func.overloadpacket.__name__, ms, first.numel() * first.element_size()))
        return out


def heavy_ops(attention: str, rounds: int) -> list:
    """``(name, fastest ms, output bytes)`` per heavy op of one forward of the layer."""
    torch.manual_seed(0)
    config = BertConfig(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                        attn_implementation=attention)
    layer = BertLayer(config).eval()
    x = torch.randn(8, 256, 768)
    runs = []
    with torch.no_grad():
        for _ in range(rounds + 1):
            timer = _HeavyTimer()
            with timer:
                layer(x)
            runs.append(timer.ops)
    return [(name, min(run[i][1] for run in runs[1:]), nbytes) for i, (name, _, nbytes) in enumerate(runs[0])]


def compare(ops: list, fraction: float) -> dict:
    total_ms, total_bytes = sum(o[1] for o in ops), sum(o[2] for o in ops)
    budget = fraction * total_bytes
    kept, held = 0, 0
    for _, _, nbytes in ops:
        if held + nbytes > budget:
            break
        kept, held = kept + 1, held + nbytes
    best = min((total_ms - sum(ops[i][1] for i in subset), sum(ops[i][2] for i in subset), subset)
               for k in range(len(ops) + 1) for subset in itertools.combinations(range(len(ops)), k)
               if sum(ops[i][2] for i in subset) <= budget)
    return {"fraction": fraction, "prefix_recompute_ms": sum(o[1] for o in ops[kept:]), "prefix_kept_bytes": held,
            "best_recompute_ms": best[0], "best_kept_bytes": best[1], "best_kept_ops": list(best[2])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for attention in ("sdpa", "eager"):
        ops = heavy_ops(attention, args.rounds)
        print(f"{attention}: " + ", ".join(f"{n} {ms:.0f} ms {b / 2**20:.0f} MiB" for n, ms, b in ops))
        print(f"{'keep <=':>8} {'prefix ms':>10} {'prefix MiB':>10} {'best ms':>8} {'best MiB':>9} "
              f"{'best/prefix':>11}  kept")
        for fraction in FRACTIONS:
            row = {"attention": attention, "ops": [list(o) for o in ops], **compare(ops, fraction)}
            rows.append(row)
            print(f"{fraction:8.2f} {row['prefix_recompute_ms']:10.1f} {row['prefix_kept_bytes'] / 2**20:10.1f} "
                  f"{row['best_recompute_ms']:8.1f} {row['best_kept_bytes'] / 2**20:9.1f} "
                  f"{row['best_recompute_ms'] / max(row['prefix_recompute_ms'], 1e-9):11.2f}  {row['best_kept_ops']}")
    write_results("partial_order", rows, rounds=args.rounds, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
