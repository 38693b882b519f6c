"""Oracle: the reference limit, not a competitor.

For each new input size it runs one side-effect-free step on that batch with Mimose's shuttling
collector (collector.py): every block's bytes, forward, backward and recompute peaks and forward
time, and the head's and embeddings' peaks, measured at this very size, nothing fitted. A plan's
peak is then the step's memory timeline evaluated on those measurements (``peak_timeline``, whose
step peaks match the simulated device to < 0.01 % on the transformers tested). The oracle picks
the plan with the least recompute time (Σ measured forward ms) whose peak, on top of the bytes
at the step's start, fits the budget: an exact search over every plan up to ``EXACT_MAX_BLOCKS``
blocks; beyond, a knapsack DP on the blocks' savings, topped up block by block until the
timeline fits. With finer plans (``choices="selective"``) the least over every keep / selective /
partial (``features.PARTIAL_LEVELS``) / recompute plan: found block by block, carrying the partial
plans no other beats (``_frontier_search``, exact for any number of blocks whose backward runs in
the reverse of their forward, where no input is let go of and the plans to carry stay few), else by
trying every plan up to ``EXACT_MAX_CHOICE_PLANS`` plans, else Mimose's scheduler on the
measurements (``stats``: ``frontier_searches``, ``exact_searches``, ``scheduler_searches``); with
``choices="offload"`` the same plans, a block freed
whole offloaded where its copies cost less than its recompute (``choices.freeing_ms``), as Mimose's.
The times of alike blocks (the layers of a stack, ``blocks.twin_blocks``) that measured the same
bytes are given their mean (``alike_at``, ``blocks.alike_mean``): one step's timings of identical
layers differ by tens of percent on a busy CPU, and a plan should not take layer 7 over layer 2
for that. Measuring and searching are excluded from the step's time (``Decision.excluded_ms``);
measurements are kept per input size.
"""

import time

import numpy as np

from mimose_cli.planners.base import Planner
from mimose_cli.planners.baselines.sublinear import BlockProfile
from mimose_cli.planners.blocks import (
    PARTIAL_LEVELS,
    RECOMPUTE,
    offloading,
    plan_levels,
    plan_of_levels,
    recomputed,
    selectable,
)
from mimose_cli.planners.contract import NO_CONTEXT, Decision, Policy, StepContext, StepInfo
from mimose_cli.planners.mimose.choices import (
    choice_plan_checked,
    copy_costs_ms,
    dispatch_costs_ms,
    level_rows,
    priced_freeing,
)
from mimose_cli.planners.mimose.collector import ShuttlingCollector
from mimose_cli.planners.mimose.estimator import (
    BLOCK_QUANTITIES,
    NO_EVENT,
    STEP_QUANTITIES,
    Prediction,
    Timeline,
    plan_peak_bytes,
)
from mimose_cli.planners.mimose.features import (
    KEEP_LEVEL,
    LEVELS,
    RECOMPUTE_LEVEL,
    SELECTIVE_LEVEL,
    feature_set_of,
    kept_quantities,
)
from mimose_cli.planners.mimose.layout import alike_mean, twin_blocks
from mimose_cli.planners.mimose.probes import time_choices
from mimose_cli.planners.mimose.scaling import SELECTIVE_QUANTITIES, partial_keeps, partial_prefixes, raw_sample
from mimose_cli.planners.parts import check_offload_device
from mimose_cli.planners.trial import probe_step, to_model_device
from mimose_cli.planners.usage import warn_user

EXACT_MAX_BLOCKS = 16
_REQUIRED = ("plain_bytes", "ckpt_bytes", "fwd_ms")


def measured_prediction(size: tuple, sample, num_blocks: int) -> Prediction | None:
    """One collector sample as a ``Prediction`` (each stretch's largest value); None when a
    block could not be measured (the data filter dropped it)."""
    blocks, step, shape = sample
    if shape is None or any(blocks[q][i] is None for q in _REQUIRED for i in range(num_blocks)):
        return None

    def value(values, quantity):
        if values is None or not len(values):  # unmeasured, or measured with no op in it
            return NO_EVENT if "peak" in quantity else 0.0
        return float(np.max(values))

    return Prediction(tuple(size),
                      {q: np.array([value(v, q) for v in blocks[q]]) for q in BLOCK_QUANTITIES},
                      {q: value(step[q], q) for q in STEP_QUANTITIES}, shape.order, shape.backward_reversed)


def plan_peak(pred: Prediction, blocks) -> float:
    """The measured step peak above its start with the blocks at the indices ``blocks`` recomputed
    (the block-level searches' plans)."""
    return plan_peak_bytes(pred, recomputed(blocks, len(pred.savings)))


EXACT_MAX_CHOICE_PLANS = 3 ** 12
"""Where ``_frontier_search`` does not apply, up to this many plans the finer-plan oracle tries
every plan (3^12 = 531441: 12 blocks of three choices, fewer with the partial levels; in chunks of
``_CHOICE_CHUNK``), the peaks only of plans no dearer than the scheduler's plan: 0.15 s per input
size for 12 blocks on the 2-core CPU, up to ~1 s where nothing fits; excluded from the step's
time. Beyond, Mimose's scheduler on the measurements."""
_CHOICE_CHUNK = 3 ** 8


def choice_search(pred: Prediction, limit_bytes: float, recompute_ms: np.ndarray, selective_ms: np.ndarray,
                  selectable: np.ndarray, partial_ms: np.ndarray | None = None, searched: dict | None = None) -> tuple:
    """Finer plans (``choices="selective"``): the plan (one choice per block) with the least
    recompute time whose measured peak fits, over every block kept, checkpointed selectively,
    partially (``partial_ms``: each partial level's ms, NaN where a block has none) or recomputed:
    block by block where it applies (``_frontier_search``), else every plan up to
    ``EXACT_MAX_CHOICE_PLANS`` plans, beyond them Mimose's scheduler (``choices.choice_plan_checked``)
    on the measurements. A block's selective or partial checkpoint
    that frees nothing (``choices.level_rows``), or a block that holds buffers (``selectable``
    False), is not a choice; every block recomputed when nothing fits. Ties (in whole nanoseconds,
    so that alike blocks' equal times tie exactly) go to fewer blocks, then to the plan met first,
    the earlier blocks upgraded (their savings last longest in backward). ``searched`` counts which
    search ran (``"frontier"``, ``"exact"`` or ``"scheduler"``)."""
    n = len(recompute_ms)
    every = (RECOMPUTE,) * n
    if partial_ms is None:
        partial_ms = np.full((n, len(PARTIAL_LEVELS)), np.nan)
    timeline = Timeline(pred)
    # Per selective checkpoint (selective, then each partial level): what it frees, where useful
    # (a measured prediction lets go of no input: what it frees is plain less checkpointed bytes).
    open_to = [selectable, *(selectable & ~np.isnan(ms) for ms in partial_ms.T)]
    savings, costs = level_rows(pred, open_to, selective_ms, partial_ms, recompute_ms)
    freed = savings[1:-1]
    # Each block's levels (keep, the useful selective checkpoints, recompute), as the digits of a
    # mixed-radix number: plan k of the search is k's digits.
    allowed = [(KEEP_LEVEL, *(SELECTIVE_LEVEL + k for k in range(len(freed)) if not np.isnan(freed[k][i])),
                RECOMPUTE_LEVEL) for i in range(n)]
    radix = np.array([len(a) for a in allowed])
    level_ns = np.stack([np.zeros(n), selective_ms, *partial_ms.T, recompute_ms], axis=1) * 1e6
    level_ns = np.round(np.nan_to_num(level_ns, nan=0.0)).astype(np.int64)
    found = _frontier_search(timeline, allowed, level_ns, limit_bytes)
    exact = found is None and float(np.prod(radix.astype(float))) <= EXACT_MAX_CHOICE_PLANS
    if searched is not None:
        key = "exact" if exact else "frontier" if found is not None else "scheduler"
        searched[key] = searched.get(key, 0) + 1
    if found is not None:
        return plan_of_levels(found) if found else every
    # The scheduler on the measurements: the answer beyond every plan, else the bound below.
    plan, _, fits = choice_plan_checked(savings, costs, timeline.level_peaks, limit_bytes)
    if not exact:
        return plan if fits else every
    place = np.concatenate(([1], np.cumprod(radix)[:-1]))
    table = np.array([a + (RECOMPUTE_LEVEL,) * (LEVELS - len(a)) for a in allowed])

    def key(levels: np.ndarray) -> np.ndarray:  # recompute ns, then the blocks upgraded
        return level_ns[np.arange(n), levels].sum(axis=-1) * (n + 1) + (levels > 0).sum(axis=-1)

    best, bound = None, np.iinfo(np.int64).max
    if fits:  # no plan dearer than the scheduler's can be the least: their peaks are not needed
        bound = int(key(np.array(plan_levels(plan)))) + 1
    total = int(np.prod(radix))
    for start in range(0, total, _CHOICE_CHUNK):
        k = np.arange(start, min(start + _CHOICE_CHUNK, total))
        levels = table[np.arange(n), (k[:, None] // place) % radix]
        keys = key(levels)
        cheaper = keys < bound
        if not cheaper.any():
            continue
        levels, keys = levels[cheaper], keys[cheaper]
        fit = timeline.level_peaks(levels) <= limit_bytes
        if fit.any():
            at = int(np.argmin(np.where(fit, keys, np.iinfo(np.int64).max)))
            if keys[at] < bound:
                best, bound = levels[at], int(keys[at])
    if best is None:
        return every
    return plan_of_levels(best.tolist())


def _frontier_search(timeline: Timeline, allowed: list, level_ns: np.ndarray, limit_bytes: float):
    """``choice_search``'s exact answer where there are too many plans to try each: the levels per
    block (a list; empty where no plan fits), or None where this search does not apply (blocks
    that let inputs go, a backward out of order, more than ``_FRONTIER_MAX`` partial plans to
    carry, or more than ``_FRONTIER_BUCKETS`` sums of what plain blocks leave until the forward
    ends) and the caller falls back.

    With the blocks run in order and backward in reverse, every event of a plan's step is what the
    blocks before one hold (and what the plain ones among them leave until the forward ends: autocast's
    cached casts) plus a term of that block's level, and the head's is the whole sums plus a
    constant (``Timeline.in_order_terms``). So the blocks are taken in forward order, carrying each
    partial plan's two sums and its key (recompute ns times blocks + 1, plus the blocks upgraded:
    the order of every-plan search); a partial plan whose events pass the limit is dropped, and one
    is dropped where another holds no more in either sum and comes first by key, then by the
    every-plan search's order (the lower levels at the higher blocks), as any completion of it is
    then beaten. Exact, with its ties, as trying every plan."""
    terms = timeline.in_order_terms()
    if terms is None:
        return None
    n, order = timeline.blocks, terms.order
    held = np.zeros(1)  # per partial plan: the sum the blocks so far hold
    left = np.zeros(1)  # and the sum the plain ones among them leave until the forward ends
    key = np.zeros(1, dtype=np.int64)
    levels = np.zeros((1, 0), dtype=np.intp)
    for position, block in enumerate(order):
        choices = np.array(allowed[block], dtype=np.intp)
        at = held + terms.pre
        fwd, own = terms.fwd[choices, position][None, :], terms.own[choices, position][None, :]
        if terms.resident is None:
            events = at[:, None] + np.maximum(fwd, own)
        else:
            events = np.maximum(at[:, None] + fwd, (at + left)[:, None] + own)
        plans, picks = np.nonzero(events <= limit_bytes)  # (plans, choices)
        if not len(plans):
            return []
        held = held[plans] + terms.held[choices[picks], position]
        if terms.resident is not None:
            left = left[plans] + terms.resident[choices[picks], position]
        key = key[plans] + level_ns[block, choices[picks]] * (n + 1) + (choices[picks] > 0)
        levels = np.concatenate((levels[plans], choices[picks][:, None]), axis=1)
        # Where each comes in the every-plan search among these: its levels compared from the
        # highest block down (the search's last digit changes slowest); then by key first.
        by_index = sorted(range(position + 1), key=lambda p: order[p])
        rank = np.empty(len(key), dtype=np.int64)
        rank[np.lexsort([levels[:, p] for p in by_index])] = np.arange(len(key))
        first = np.empty(len(key), dtype=np.int64)
        first[np.lexsort((rank, key))] = np.arange(len(key))
        kept = _unbeaten(held, left if terms.resident is not None else None, first)
        if kept is None:
            return None
        held, key, levels, first = held[kept], key[kept], levels[kept], first[kept]
        if terms.resident is not None:
            left = left[kept]
        if len(held) > _FRONTIER_MAX:
            return None
    top = held + terms.pre
    if terms.resident is None:
        head = top + np.maximum(terms.head, terms.head_bwd)
    else:
        head = top + np.maximum(terms.head, terms.head_bwd + left)
    fits = (head <= limit_bytes) & (terms.fixed <= limit_bytes)
    if not fits.any():
        return []
    candidates = np.flatnonzero(fits)
    best = candidates[np.argmin(first[candidates])]
    by_block = [0] * n
    for position, block in enumerate(order):
        by_block[block] = int(levels[best, position])
    return by_block


def _unbeaten(held: np.ndarray, left: np.ndarray | None, first: np.ndarray) -> np.ndarray | None:
    """The partial plans no other beats (indices): another beats one where it holds no more
    (``held``, and ``left`` where given) and comes ``first`` (distinct integers). Sorted by what
    they hold, then by ``first``, a plan is kept where it comes before every plan ahead of it that
    leaves no more; per value of ``left``, one pass. None with more than ``_FRONTIER_BUCKETS``
    values of ``left``."""
    sort = np.lexsort((first, held))
    order = first[sort]
    never = np.iinfo(np.int64).max
    if left is None:
        values, left_sorted = [None], None
    else:
        values, left_sorted = np.unique(left).tolist(), left[sort]
        if len(values) > _FRONTIER_BUCKETS:
            return None
    kept = np.zeros(len(sort), dtype=bool)
    before = np.empty(len(sort), dtype=np.int64)  # the least ``first`` ahead of each
    before[0] = never
    for value in values:
        ranks = order if value is None else np.where(left_sorted <= value, order, never)
        np.minimum.accumulate(ranks[:-1], out=before[1:])
        ahead = order < before
        kept |= ahead if value is None else ahead & (left_sorted == value)
    return sort[kept]


_FRONTIER_MAX = 1 << 17
"""``_frontier_search``'s most partial plans carried from one block to the next."""
_FRONTIER_BUCKETS = 64
"""``_frontier_search``'s most distinct sums of what plain blocks leave until the forward ends
(alike layers leave alike bytes: one sum per count of plain layers)."""


def exact_search(pred: Prediction, limit_bytes: float) -> tuple:
    """Least recompute time over all 2^n plans whose timeline peak fits; ties go to fewer blocks.
    Every block when nothing fits."""
    ms = pred.blocks["fwd_ms"]
    n = len(ms)
    masks = ((np.arange(2 ** n, dtype=np.int64)[:, None] >> np.arange(n)) & 1).astype(bool)
    peaks = Timeline(pred).peaks(masks)
    cost = masks @ ms + masks.sum(axis=1) * 1e-9
    cost[peaks > limit_bytes] = np.inf
    best = int(np.argmin(cost))
    if not np.isfinite(cost[best]):
        return tuple(range(n))
    return tuple(int(i) for i in np.flatnonzero(masks[best]))


def knapsack_search(pred: Prediction, limit_bytes: float) -> tuple:
    """Many blocks: the knapsack DP on what checkpointing each block frees (``knapsack_plan``),
    then the largest-saving blocks left added until the timeline fits."""
    savings, timeline = pred.savings, Timeline(pred)
    none_peak = timeline.plan_peak(recomputed((), len(savings)))
    profile = BlockProfile(pred.size, savings.tolist(), pred.blocks["fwd_ms"].tolist(),
                           fixed_bytes=none_peak - float(savings.sum()))
    plan = set(knapsack_plan(profile, limit_bytes))
    for index in sorted(range(len(savings)), key=lambda i: (-savings[i], i)):
        if timeline.plan_peak(recomputed(plan, len(savings))) <= limit_bytes:
            break
        plan.add(index)
    return tuple(sorted(plan))


def optimal_plan(pred: Prediction, limit_bytes) -> tuple:
    """The least-recompute plan whose measured peak fits ``limit_bytes`` (bytes above the step's
    start; no plan without a limit)."""
    if limit_bytes is None or plan_peak(pred, ()) <= limit_bytes:
        return ()
    if len(pred.blocks["fwd_ms"]) <= EXACT_MAX_BLOCKS:
        return exact_search(pred, limit_bytes)
    return knapsack_search(pred, limit_bytes)


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


_FORWARD_BYTES = ("saved_bytes", "plain_bytes", "ckpt_bytes", "selective_extra_bytes", "fwd_peak_bytes",
                  "ckpt_fwd_peak_bytes", "selective_fwd_peak_bytes")


class OraclePolicy(Policy):
    """Per batch, the least-recompute plan that fits, from measurements at that input size."""

    name = "oracle"

    def __init__(self, parts):
        super().__init__(parts)
        choices = parts.options.choices
        if choices == "offload":
            check_offload_device(parts.model, "choices: offload", "use choices: selective")
        self.choices = choices
        self.measurer = ShuttlingCollector(parts.model, parts.blocks)
        self.measurer.lifetimes = choices != "block"  # the selective bytes (``scaling.selective_bytes``)
        self.selectable = np.array(selectable(self.parts.blocks))
        self.twins = twin_blocks(self.parts.blocks)
        self.choice_ms: dict = {}  # input size -> (recompute ms, selective ms[, offload ms]) per block
        self.partial_ms: dict = {}  # input size -> each partial level's ms per block (blocks x levels)
        self.prefixes: list | None = None  # what the partial levels keep, per block (``scaling.partial_prefixes``)
        self._dispatch_costs = None
        self._copy_costs = None  # ``choices.copy_costs_ms``, timed once (``choices="offload"``)
        self.storages: dict = {}  # input size -> the storages each block saved (``choices="offload"``)
        self.measured: dict = {}  # input size -> Prediction, or None when it could not be measured
        self._make_batch = None
        self.excluded_ms_total = 0.0
        self.margin_bytes = 0
        self.searched: dict = {}  # finer plans: how many sizes each search planned (``choice_search``)

    def prepare(self, make_batch, max_input_size: tuple, reserve_bytes: int = 0, step_fn=None) -> None:
        # the oracle plans each step against the bytes live at its start: nothing to reserve
        self._make_batch = make_batch

    def measure(self, size: tuple, batch=None) -> Prediction | None:
        """One side-effect-free collector step at ``size`` on ``batch`` (the step's; without one,
        a batch made at that size): RNG forked, buffers and gradients restored, the meter's peak
        reset."""
        if batch is None:
            if self._make_batch is None:
                raise RuntimeError("oracle measures every input size: pass the batch to "
                                   "planner.step(batch) or call planner.prepare(make_batch, ...)")
            batch = to_model_device(self.parts.model, self._make_batch(size))
        self.measurer.begin(inputs=batch)
        ran = False
        try:
            with self.parts.router.using(self.measurer):
                ran = probe_step(self.parts, batch) is not None
        finally:
            sample = self.measurer.end() if ran else self.measurer.abort()  # abort keeps nothing
        times = None
        if sample is not None and self.measurer.lifetimes:
            # What each partial level keeps, fixed per block where first found (the same ops at
            # every size; a block dropped at one size gets its levels at the next).
            found = partial_prefixes(sample, self.parts.num_blocks, {})
            self.prefixes = found if self.prefixes is None else [
                kept if kept is not None else new for kept, new in zip(self.prefixes, found)]
            self.parts.plan_runner.partial_keep = partial_keeps(self.prefixes)
            raw, sample = sample, raw_sample(sample, self.parts.num_blocks,
                                             partial_keep=self.parts.plan_runner.partial_keep)
            if any(v is None for q in SELECTIVE_QUANTITIES for v in sample[0][q]):  # unmeasured: block-level only
                raw = None
            if self._dispatch_costs is None:
                self._dispatch_costs = dispatch_costs_ms()
            feature_set = feature_set_of(self.parts)
            times = None
            if raw is not None:  # the times, and the heavy outputs a selective checkpoint keeps, as Mimose's probes'
                found = time_choices([raw, raw], [size, size], feature_set, {}, self.prefixes, self._dispatch_costs)
                times = found.times
                self.parts.plan_runner.selective_keep.update(found.selective_keep)
            self.choice_ms[size] = None if times is None else times.at(feature_set.of(size))
            partial_ms = None if times is None else times.partial_at(feature_set.of(size), self.choice_ms[size][1])
            if partial_ms is not None:  # a level whose bytes this size did not give: not a choice here
                for k, level in enumerate(PARTIAL_LEVELS):
                    partial_ms[[v is None for v in sample[0][kept_quantities(level)[0]]], k] = np.nan
            self.partial_ms[size] = partial_ms
        pred = None if sample is None else measured_prediction(size, sample, self.parts.num_blocks)
        if pred is not None and self.choice_ms.get(size) is not None and self.choices == "offload":
            if self._copy_costs is None:
                self._copy_costs = self._timed_copies()
            times.copy_ms = self._copy_costs or None  # False: their timing failed (said once)
            offload_ms = times.offload_at(pred.blocks["saved_bytes"])
            if offload_ms is not None:
                self.choice_ms[size] += (offload_ms,)
                self.storages[size] = times.storages
            elif self._copy_costs:
                warn_user("oracle: a size's blocks are not offloaded (choices: offload asked for): the probe did "
                          "not count the storages they save")
        if pred is not None:
            alike = self.alike_at(pred)
            pred.blocks["fwd_ms"] = alike_mean(pred.blocks["fwd_ms"], alike)
            if self.choice_ms.get(size) is not None:
                self.choice_ms[size] = tuple(alike_mean(t, alike) for t in self.choice_ms[size])
            if self.partial_ms.get(size) is not None:
                self.partial_ms[size] = np.stack([alike_mean(t, alike) for t in self.partial_ms[size].T], axis=1)
        if pred is None:
            warn_user(f"oracle: input size {size} could not be measured (out of memory, or a "
                      "block the collector cannot attribute); checkpointing every block")
        return pred

    def _timed_copies(self) -> tuple | bool:
        """``choices.copy_costs_ms`` on the model's device, off the budget; False, with a warning,
        where the copies cannot be timed (then nothing is offloaded, and they are not timed again)."""
        costs = self.parts.timed_or_warned(copy_costs_ms, "oracle: the copies' costs",
                                           lambda message: warn_user(f"{message}; no block is offloaded"))
        return False if costs is None else costs

    def alike_at(self, pred: Prediction) -> dict:
        """``{block: the first block like it}`` among alike blocks (``blocks.twin_blocks``) whose
        forward measured the same bytes at this size too (``_FORWARD_BYTES``): they ran the same
        ops on the same bytes, so their forward and recompute times differ by the timing noise
        only (``blocks.alike_mean``). A layer that runs otherwise than its twins (a pooled stage,
        a shorter sequence) measures other bytes and keeps its own time. Backward peaks are not
        compared: they differ between identical layers by the gradients held at the time."""
        first, alike = {}, {}
        for i in range(self.parts.num_blocks):
            signature = (self.twins.get(i, i), tuple(float(pred.blocks[q][i]) for q in _FORWARD_BYTES))
            lead = first.setdefault(signature, i)
            if lead != i:
                alike[i] = lead
        return alike

    def decide(self, size: tuple, context: StepContext = NO_CONTEXT) -> Decision:
        """The least-recompute plan that fits, from this size's measurements (taken now if new)."""
        start = time.perf_counter()
        hit = size in self.measured
        if self.parts.lockstep is not None:  # FSDP: every rank measures when any must (the same steps)
            hit = not self.parts.lockstep.any(not hit)
        if not hit:
            self.measured[size] = self.measure(size, context.batch)
        pred = self.measured[size]
        base = self.parts.meter.current_bytes() if self.parts.meter is not None else 0
        if pred is None:
            plan, predicted = (RECOMPUTE,) * self.parts.num_blocks, None
        else:
            limit = None if self.parts.limit_bytes is None else self.parts.limit_bytes - self.margin_bytes - base
            plan = recomputed(optimal_plan(pred, limit), self.parts.num_blocks)
            times, offloaded = self.choice_ms.get(size), np.zeros(self.parts.num_blocks, dtype=bool)
            if times is not None and limit is not None and plan_peak(pred, ()) > limit:
                recompute_ms, selective_ms, *offload_ms = times
                pred, whole_ms, offloaded = priced_freeing(pred, recompute_ms, offload_ms[0] if offload_ms else None,
                                                           self.storages.get(size))
                plan = choice_search(pred, limit, whole_ms, selective_ms, self.selectable,
                                     self.partial_ms.get(size), self.searched)
            # an offloaded block bounded as recomputed
            predicted = int(base + plan_peak_bytes(pred, plan))
            plan = offloading(plan, offloaded)
        excluded_ms = (time.perf_counter() - start) * 1e3
        self.excluded_ms_total += excluded_ms
        return Decision(plan, cache_hit=hit, predicted_peak_bytes=predicted, excluded_ms=excluded_ms)

    def observe(self, info: StepInfo, peak_bytes, sample) -> None:
        """Keep the largest measured overshoot of the measured timeline as a margin (none was
        seen on the simulated device; on a GPU the allocator's rounding can add some)."""
        if peak_bytes is not None and info.predicted_peak_bytes is not None:
            self.margin_bytes = max(self.margin_bytes, peak_bytes - info.predicted_peak_bytes)

    def stats(self, counted: dict) -> dict:
        return {"measured_sizes": len(self.measured), "excluded_ms_total": self.excluded_ms_total,
                "margin_bytes": self.margin_bytes,
                # finer plans: exact block by block, else every plan, else Mimose's scheduler's on measurements
                "frontier_searches": self.searched.get("frontier", 0),
                "exact_searches": self.searched.get("exact", 0),
                "scheduler_searches": self.searched.get("scheduler", 0)}


def Oracle(model, budget=None, **options) -> Planner:
    """``Planner(model, OraclePolicy, budget, **options)`` (``choices``: block, selective or offload)."""
    return Planner(model, OraclePolicy, budget, **options)
