"""How long the finer-plan oracle's exact search takes per input size, and which search it ran.

``oracle.choice_search`` over keep / selective / three partial levels / recompute on made-up
stacks of 12, 24 and 48 blocks (random bytes and peaks, as tests/planners/test_oracle.py makes
them; times alike within a stack, as ``alike_mean`` gives a stack's layers, or each its own), the
limit between every block checkpointed and none. Where plain blocks leave bytes until the forward
ends (autocast's cached casts) none, alike (one value: a stack's layers) or their own: the
block-by-block search (``_frontier_search``) carries that sum too, up to 64 distinct sums, else
the scheduler answers. Each case is timed ``--repeats`` times, the median reported; the search
that answered is counted (``searched``). Writes benchmarks/results/oracle_search.json.

    python benchmarks/oracle_search.py [--blocks 12,24,48] [--repeats 5]
"""

import argparse
import random
import statistics
import time

import numpy as np

from mimose_cli.planners.baselines.oracle import choice_search
from mimose_cli.planners.blocks import KEEP, PARTIAL_LEVELS, RECOMPUTE, SELECTIVE, checkpointed
from mimose_cli.planners.mimose.estimator import BLOCK_QUANTITIES, STEP_QUANTITIES, Prediction, plan_peak_bytes

from _results import write_results

CACHED_CASTS = ("none", "alike", "own")


def _stack(rng: random.Random, n: int, alike_times: bool, casts: str) -> tuple:
    """A made-up stack: its prediction, a limit between every block checkpointed and none, and
    ``choice_search``'s times (recompute, selective, selectable, partial)."""
    blocks = {q: np.array([rng.randint(0, 40) for _ in range(n)], dtype=float) for q in BLOCK_QUANTITIES}
    plain = np.array([rng.randint(20, 100) for _ in range(n)], dtype=float)
    blocks.update(plain_bytes=plain, ckpt_bytes=np.array([rng.randint(1, 10) for _ in range(n)], dtype=float))
    blocks["fwd_peak_bytes"] += plain
    blocks["recompute_peak_bytes"] += plain
    blocks["resident_bytes"] = {"none": np.zeros(n), "alike": np.full(n, 7.0),
                                "own": np.array([rng.randint(0, 40) for _ in range(n)], dtype=float)}[casts]
    pred = Prediction((1, 1), blocks, {q: float(rng.randint(0, 30)) for q in STEP_QUANTITIES})
    if alike_times:
        recompute = np.full(n, 2.0)
        selective, partial = recompute * 0.5, np.stack([recompute * f for f in (0.6, 0.7, 0.8)], axis=1)
    else:
        recompute = np.array([rng.uniform(0.5, 3.0) for _ in range(n)])
        selective = recompute * np.array([rng.uniform(0.1, 1.2) for _ in range(n)])
        partial = recompute[:, None] * np.array([[rng.uniform(0.1, 1.2) for _ in range(3)] for _ in range(n)])
    none, every = plan_peak_bytes(pred, (KEEP,) * n), plan_peak_bytes(pred, (RECOMPUTE,) * n)
    limit = every + 0.4 * (none - every)
    return pred, limit, (recompute, selective, np.ones(n, dtype=bool), partial)


def measure(n: int, alike_times: bool, casts: str, repeats: int) -> dict:
    pred, limit, times = _stack(random.Random(n), n, alike_times, casts)
    searched, ms = {}, []
    for _ in range(repeats):
        searched = {}
        start = time.perf_counter()
        plan = choice_search(pred, limit, *times, searched=searched)
        ms.append((time.perf_counter() - start) * 1e3)
    return {"blocks": n, "times": "alike" if alike_times else "own", "cached_casts": casts,
            "search": next(iter(searched)), "median_ms": statistics.median(ms), "min_ms": min(ms),
            "checkpointed": len(checkpointed(plan)), "selective": plan.count(SELECTIVE),
            "partial": sum(choice in PARTIAL_LEVELS for choice in plan)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="12,24,48")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    print(f"{'blocks':>6} {'times':>6} {'cached casts':>12} {'search':>10} {'median ms':>10} {'min ms':>8} "
          f"{'ckpt (sel, part)':>17}")
    for n in (int(b) for b in args.blocks.split(",")):
        for alike_times in (False, True):
            for casts in CACHED_CASTS:
                row = measure(n, alike_times, casts, args.repeats)
                rows.append(row)
                print(f"{n:6} {row['times']:>6} {casts:>12} {row['search']:>10} {row['median_ms']:10.1f} "
                      f"{row['min_ms']:8.1f} {row['checkpointed']:>6} ({row['selective']}, {row['partial']})",
                      flush=True)
    write_results("oracle_search", rows, repeats=args.repeats)


if __name__ == "__main__":
    main()
