"""Oracle: the reference limit, not a competitor.

For each batch it measures its input size (per-block activation bytes and forward ms, and the
peak no plan changes; ``profile.py``) and picks the plan with the least recompute time whose
modelled peak fits the budget: an exact search over every subset of blocks up to
``EXACT_MAX_BLOCKS`` blocks, else a knapsack DP. Measuring and searching are excluded from the
step's time (``StepInfo.extra["excluded_ms"]``); measurements are kept per input size.
"""

import contextlib
import time

import numpy as np

from mimose_cli.planners.base import StepInfo
from mimose_cli.planners.profile import BlockProfile, ProfilingPlanner, measure_fixed_bytes, to_model_device

EXACT_MAX_BLOCKS = 16


def exact_plan(profile: BlockProfile, limit_bytes) -> tuple:
    """Least recompute time over all 2^n plans whose ``profile.peak_bytes`` fits, vectorised.

    Ties go to fewer blocks. Returns every block when nothing fits.
    """
    act = np.asarray(profile.act_bytes, dtype=np.float64)
    ms = np.asarray(profile.fwd_ms, dtype=np.float64)
    n = len(act)
    subsets = np.arange(2 ** n, dtype=np.int64)[:, None]
    in_plan = ((subsets >> np.arange(n)) & 1).astype(bool)
    kept = np.where(in_plan, 0.0, act)
    before = np.cumsum(kept, axis=1) - kept
    recompute_peak = np.where(in_plan, before + act, 0.0).max(axis=1)
    peak = profile.fixed_bytes + np.maximum(kept.sum(axis=1), recompute_peak)
    cost = in_plan @ ms + in_plan.sum(axis=1) * 1e-9  # fewer blocks on equal time
    cost[peak > limit_bytes] = np.inf
    best = int(np.argmin(cost))
    if not np.isfinite(cost[best]):
        return tuple(range(n))
    return tuple(int(i) for i in np.flatnonzero(in_plan[best]))


def min_cost_cover(sizes, costs, target: float, units: int = 1024):
    """Cheapest subset whose sizes sum to at least ``target`` (0/1 knapsack DP over bytes
    rounded down to ``units`` steps, so a chosen subset truly covers the target).

    Returns ``(cost, indices)`` or None when even all items fall short.
    """
    if target <= 0:
        return 0.0, ()
    if sum(sizes) < target:
        return None
    step = target / units
    need = units
    dp = np.full(need + 1, np.inf)
    dp[0] = 0.0
    take = np.zeros((len(sizes), need + 1), dtype=bool)
    index = np.arange(need + 1)
    for k, (size, cost) in enumerate(zip(sizes, costs)):
        gain = int(size // step)
        if gain == 0:
            continue  # covers nothing at this resolution
        shifted = dp[np.maximum(0, index - gain)] + cost
        better = shifted < dp
        take[k] = better
        dp = np.where(better, shifted, dp)
    if not np.isfinite(dp[need]):
        return None
    chosen, c = [], need
    for k in range(len(sizes) - 1, -1, -1):
        if take[k, c]:
            chosen.append(k)
            c = max(0, c - int(sizes[k] // step))
    return float(dp[need]), tuple(sorted(chosen))


def knapsack_plan(profile: BlockProfile, limit_bytes) -> tuple:
    """For many blocks: least recompute time s.t. the kept activations plus the largest
    checkpointed block fit (a conservative bound on ``peak_bytes``). For each block m as the
    largest of the plan, cover the excess with blocks no larger than m."""
    act, ms = profile.act_bytes, profile.fwd_ms
    target = profile.fixed_bytes + sum(act) - limit_bytes
    best = None
    for m in range(len(act)):
        others = [j for j in range(len(act)) if j != m and act[j] <= act[m]]
        found = min_cost_cover([act[j] for j in others], [ms[j] for j in others], target)
        if found is None:
            continue
        plan = tuple(sorted((m,) + tuple(others[k] for k in found[1])))
        if best is None or found[0] + ms[m] < best[0]:
            best = (found[0] + ms[m], plan)
    return best[1] if best else tuple(range(len(act)))


def optimal_plan(profile: BlockProfile, limit_bytes) -> tuple:
    """The least-recompute plan that fits ``limit_bytes`` (no plan without a limit)."""
    if limit_bytes is None or profile.none_peak_bytes <= limit_bytes:
        return ()
    if len(profile.act_bytes) <= EXACT_MAX_BLOCKS:
        return exact_plan(profile, limit_bytes)
    return knapsack_plan(profile, limit_bytes)


class Oracle(ProfilingPlanner):
    """Per batch, the least-recompute plan that fits, from measurements at that input size."""

    name = "oracle"

    def __init__(self, model, budget=None, **kwargs):
        super().__init__(model, budget, **kwargs)
        self.profiles: dict = {}
        self._make_batch = None
        self._batch = None
        self.excluded_ms_total = 0.0
        self.margin_bytes = 0

    def prepare(self, make_batch, max_input_size: tuple) -> None:
        self._make_batch = make_batch

    @contextlib.contextmanager
    def step(self, batch=None, input_size=None):
        self._batch = batch
        try:
            with super().step(batch, input_size) as info:
                yield info
        finally:
            self._batch = None

    def measure(self, size: tuple) -> BlockProfile:
        """Measure the blocks at ``size`` on this step's batch (or one made at that size)."""
        batch = self._batch
        if batch is None:
            if self._make_batch is None:
                raise RuntimeError("oracle measures every input size: pass the batch to "
                                   "planner.step(batch) or call planner.prepare(make_batch, ...)")
            batch = to_model_device(self.model, self._make_batch(size))
        act_bytes, fwd_ms = self.profiler.measure(batch)
        fixed = measure_fixed_bytes(self, batch, act_bytes)
        return BlockProfile(size, act_bytes, fwd_ms, fixed)

    def make_step_info(self, size: tuple) -> StepInfo:
        start = time.perf_counter()
        hit = size in self.profiles
        if not hit:
            self.profiles[size] = self.measure(size)
        profile = self.profiles[size]
        limit = None if self.limit_bytes is None else self.limit_bytes - self.margin_bytes
        plan = optimal_plan(profile, limit)
        excluded_ms = (time.perf_counter() - start) * 1e3
        self.excluded_ms_total += excluded_ms
        return StepInfo(step=self.steps, input_size=size, plan=plan, planning_ms=0.0,
                        cache_hit=hit, predicted_peak_bytes=profile.peak_bytes(plan),
                        extra={"excluded_ms": excluded_ms,
                               "predicted_recompute_ms": profile.recompute_ms(plan)})

    def decide(self, input_size: tuple) -> tuple:
        return self.make_step_info(tuple(input_size)).plan

    def observe(self, info: StepInfo, peak_bytes) -> None:
        """Keep the largest measured overshoot of the modelled peak as a margin (the model
        leaves out backward transients that differ from the calibration step's)."""
        if peak_bytes is not None and info.predicted_peak_bytes is not None:
            self.margin_bytes = max(self.margin_bytes, peak_bytes - info.predicted_peak_bytes)

    @property
    def stats(self) -> dict:
        stats = super().stats
        stats.update(measured_sizes=len(self.profiles), excluded_ms_total=self.excluded_ms_total,
                     margin_bytes=self.margin_bytes)
        return stats
