"""Oracle: the least-recompute plan that fits, from measurements at each input size."""

import itertools
import random

import numpy as np
import pytest
import torch

from mimose_cli.memory import build_meter
from mimose_cli.planners import Decision, build_planner
from mimose_cli.planners.baselines.oracle import (
    choice_search,
    exact_search,
    knapsack_plan,
    knapsack_search,
    min_cost_cover,
    plan_peak,
)
from mimose_cli.planners.baselines.sublinear import BlockProfile
from mimose_cli.planners.blocks import PARTIAL_LEVELS, checkpointed, plan_of_levels, recompute_first, recomputed
from mimose_cli.planners.mimose.estimator import BLOCK_QUANTITIES, STEP_QUANTITIES, Prediction, Timeline
from mimose_cli.planners.mimose.features import KEEP_LEVEL, KEPT_SETS, LEVELS, RECOMPUTE_LEVEL, SELECTIVE_LEVEL

from helpers import bert_batch, tiny_bert


def random_prediction(rng, n):
    """Block quantities of a made-up stack: plain > checkpointed bytes, peaks around them."""
    plain = np.array([rng.randint(20, 100) for _ in range(n)], dtype=float)
    ckpt = np.array([rng.randint(1, 10) for _ in range(n)], dtype=float)
    blocks = {q: np.array([rng.randint(0, 40) for _ in range(n)], dtype=float) for q in BLOCK_QUANTITIES}
    blocks.update(plain_bytes=plain, ckpt_bytes=ckpt, fwd_ms=np.array([rng.uniform(0.5, 3.0) for _ in range(n)]))
    blocks["fwd_peak_bytes"] = plain + blocks["fwd_peak_bytes"]
    blocks["recompute_peak_bytes"] = plain + blocks["recompute_peak_bytes"]
    step = {q: float(rng.randint(0, 30)) for q in STEP_QUANTITIES}
    return Prediction((1, 1), blocks, step)


def brute_force(pred, limit):
    n = len(pred.blocks["fwd_ms"])
    fitting = [plan for k in range(n + 1) for plan in itertools.combinations(range(n), k)
               if plan_peak(pred, plan) <= limit]
    return min(sum(pred.blocks["fwd_ms"][list(p)]) for p in fitting) if fitting else None


def test_exact_search_matches_brute_force_on_the_timeline():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(2, 7)
        pred = random_prediction(rng, n)
        limit = rng.randint(60, 500)
        best = brute_force(pred, limit)
        plan = exact_search(pred, limit)
        if best is None:
            assert plan == tuple(range(n))
        else:
            assert plan_peak(pred, plan) <= limit
            assert abs(sum(pred.blocks["fwd_ms"][list(plan)]) - best) < 1e-9


def _every_choice_plan(pred, limit, level_ms, usable):
    """The finer-plan search written plainly: every plan over the levels ``level_ms`` prices
    (``{level: ms per block}``, keep at 0 ms; ``usable[level]`` the blocks that may take it) at
    once, the cheapest in whole nanoseconds that fits, ties to fewer blocks and then to the first
    in enumeration order (block 0 the fastest-changing digit, levels in order)."""
    n = len(level_ms[RECOMPUTE_LEVEL])
    values = np.array(sorted(level_ms))
    digits = (np.arange(len(values) ** n)[:, None] // len(values) ** np.arange(n)) % len(values)
    levels = values[digits]
    allowed = np.ones(len(levels), dtype=bool)
    for level, blocks in usable.items():
        allowed &= ~((levels == level) & ~blocks).any(axis=1)
    levels = levels[allowed]
    ns = np.zeros((LEVELS, n), dtype=np.int64)
    for level, ms in level_ms.items():
        ns[level] = np.round(np.nan_to_num(ms) * 1e6).astype(np.int64)
    cost = ns[levels, np.arange(n)].sum(axis=1)
    fits = Timeline(pred).level_peaks(levels) <= limit
    if not fits.any():
        return ("recompute",) * n
    best = min(np.flatnonzero(fits).tolist(), key=lambda k: (cost[k], (levels[k] > 0).sum(), k))
    return plan_of_levels(levels[best].tolist())


def _random_choice_case(rng, n, alike, partial=True):
    """A random stack for the finer-plan search: its prediction, limit and per-level times (the
    partial levels offered with ``partial``)."""
    pred = random_prediction(rng, n)
    if alike:
        recompute = np.array([rng.choice([1.0, 1.0, 2.0]) for _ in range(n)])
        selective = recompute * 0.5
        partial_ms = np.stack([recompute * f for f in (0.6, 0.7, 0.8)], axis=1)
    else:
        recompute = np.array([rng.uniform(0.5, 3.0) for _ in range(n)])
        selective = recompute * np.array([rng.uniform(0.1, 1.2) for _ in range(n)])
        partial_ms = recompute[:, None] * np.array([[rng.uniform(0.1, 1.2) for _ in range(3)] for _ in range(n)])
    partial_ms[np.array([[rng.random() < 0.3 for _ in range(3)] for _ in range(n)])] = np.nan
    selectable = np.array([rng.random() < 0.8 for _ in range(n)])
    none_peak, full_peak = plan_peak(pred, ()), plan_peak(pred, range(n))
    limit = full_peak + rng.uniform(-0.05, 0.9) * (none_peak - full_peak)
    level_ms, usable = {KEEP_LEVEL: np.zeros(n), RECOMPUTE_LEVEL: recompute}, {}
    for k, kept_set in enumerate(KEPT_SETS if partial else KEPT_SETS[:1]):
        extra = np.maximum(pred.blocks[f"{kept_set}_extra_bytes"], 0.0)
        level_ms[SELECTIVE_LEVEL + k] = partial_ms[:, k - 1] if k else selective
        usable[SELECTIVE_LEVEL + k] = ((pred.blocks["ckpt_bytes"] + extra < pred.blocks["plain_bytes"])
                                       & selectable & ~np.isnan(level_ms[SELECTIVE_LEVEL + k]))
    return pred, limit, (recompute, selective, selectable, partial_ms), level_ms, usable


def test_the_finer_plan_search_in_chunks_is_every_plan_at_once(monkeypatch):
    """``choice_search`` walks the plans in chunks of 3^8 (up to 3^12 plans) and skips the peaks
    of plans dearer than the scheduler's: the same plan as evaluating them all at once, on stacks
    of 2 to 11 blocks (up to 3^11 plans, many chunks) and of 2 to 6 with the partial levels too
    (up to 6^6 plans), some blocks not selectable or without a partial level, with times drawn at
    random and with alike times (equal within a stack: the ties that ``alike_mean`` makes, which
    must go to fewer blocks and then the earlier ones); every block leaves bytes until the forward
    ends, and the search block by block is switched off."""
    import mimose_cli.planners.baselines.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "_frontier_search", lambda *args: None)
    rng = random.Random(5)
    partial_plans = 0
    for n, partial in [(n, False) for n in (2, 3, 5, 7, 9, 10, 11)] + [(n, True) for n in (2, 3, 4, 5, 6)]:
        for alike in (False, True, True, True, True):
            pred, limit, times, level_ms, usable = _random_choice_case(rng, n, alike, partial)
            pred.blocks["resident_bytes"] += 1.0  # bytes left until the forward ends
            recompute, selective, selectable, partial_ms = times
            expected = _every_choice_plan(pred, limit, level_ms, usable)
            found = choice_search(pred, limit, recompute, selective, selectable, partial_ms if partial else None)
            assert found == expected, (n, alike, partial)
            partial_plans += any(choice in PARTIAL_LEVELS for choice in found)
    assert partial_plans > 5  # the partial levels were chosen, not only offered


def test_the_finer_plan_search_block_by_block_is_exact(monkeypatch):
    """Where blocks run in order and backward in reverse, the search carries partial plans block by
    block, keeping those no other beats (``oracle._frontier_search``): the same plan, ties
    included, as evaluating every plan at once, on stacks of 2 to 7 blocks with the partial levels
    (up to 6^7 plans), alike times, blocks run out of index order, and blocks that leave nothing,
    alike bytes or bytes of their own until the forward ends (autocast's cached casts: a second sum
    carried); and it says which search ran. Where it does not apply (a backward out of order, too
    many sums of what plain blocks leave) every plan is tried up to ``EXACT_MAX_CHOICE_PLANS`` (set
    to none here), then the scheduler."""
    import mimose_cli.planners.baselines.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "EXACT_MAX_CHOICE_PLANS", 0)
    rng = random.Random(11)
    searched, partial_plans, resident_plans = {}, 0, 0
    for n in (2, 3, 3, 4, 4, 5, 5, 6, 7):
        for alike, resident in ((False, "none"), (True, "none"), (True, "alike"), (False, "own"), (True, "own")):
            pred, limit, times, level_ms, usable = _random_choice_case(rng, n, alike)
            left = {"none": [0] * n, "alike": [rng.randint(1, 60)] * n, "own": [rng.randint(0, 120) for _ in range(n)]}
            pred.blocks["resident_bytes"] = np.array(left[resident], dtype=float)
            if rng.random() < 0.5:
                pred.order = tuple(rng.sample(range(n), n))
            expected = _every_choice_plan(pred, limit, level_ms, usable)
            found = choice_search(pred, limit, *times, searched=searched)
            assert found == expected, (n, alike, resident)
            partial_plans += any(choice in PARTIAL_LEVELS for choice in found)
            resident_plans += resident != "none" and len(checkpointed(found)) < n
    assert searched == {"frontier": 45} and partial_plans > 3 and resident_plans > 10
    pred, limit, times, _, _ = _random_choice_case(rng, 5, False)
    pred.backward_reversed = False
    searched = {}
    choice_search(pred, limit, *times, searched=searched)
    monkeypatch.setattr(oracle_module, "_FRONTIER_BUCKETS", 1)
    pred, limit, times, _, _ = _random_choice_case(rng, 5, False)  # own bytes left: many sums
    choice_search(pred, limit, *times, searched=searched)
    assert searched == {"scheduler": 2}


def test_the_timelines_terms_block_by_block_give_its_peaks():
    """``Timeline.in_order_terms`` (what the block-by-block search reads): what the blocks before
    each hold (and what the plain ones among them leave until the forward ends) plus its level's
    terms, the head above them all, the events before and after the blocks; their maximum is
    ``level_peaks``' peak, exactly (the same additions in the same order), for random stacks with
    and without bytes left until the forward ends, random levels and forward orders. Where inputs
    are let go of or backward runs out of order it says it does not apply."""
    rng = random.Random(3)
    for case in range(80):
        n = rng.randint(1, 8)
        pred = random_prediction(rng, n)
        if case % 4 > 1:  # fractions: sums whose order changes their rounding
            for quantities in (pred.blocks, pred.step):
                for q in quantities:
                    quantities[q] = quantities[q] * (1.0 + rng.random() / 3.0) + 0.1
        if case % 2:
            pred.blocks["resident_bytes"] = np.zeros(n)
        if rng.random() < 0.5:
            pred.order = tuple(rng.sample(range(n), n))
        timeline = Timeline(pred)
        terms = timeline.in_order_terms()
        assert (terms.resident is None) == (case % 2 == 1 or not pred.blocks["resident_bytes"].any())
        for _ in range(5):
            levels = np.array([rng.randrange(LEVELS) for _ in range(n)])
            held, left, peak = 0.0, 0.0, terms.fixed
            for position, block in enumerate(terms.order):
                level, at = levels[block], held + terms.pre
                peak = max(peak, at + terms.fwd[level, position], (at + left) + terms.own[level, position])
                held = held + terms.held[level, position]
                if terms.resident is not None:
                    left = left + terms.resident[level, position]
            peak = max(peak, (held + terms.pre) + max(terms.head, terms.head_bwd + left))
            assert peak == float(timeline.level_peaks(levels))
    pred.backward_reversed = False
    assert Timeline(pred).in_order_terms() is None


def test_knapsack_search_fits_many_blocks():
    rng = random.Random(2)
    for _ in range(10):
        pred = random_prediction(rng, 20)
        limit = (plan_peak(pred, ()) + plan_peak(pred, range(20))) / 2
        plan = knapsack_search(pred, limit)
        assert plan_peak(pred, plan) <= limit and len(plan) < 20


def test_knapsack_fits_and_is_exact_on_its_bound():
    rng = random.Random(1)
    for _ in range(20):
        n = rng.randint(3, 8)
        act = [rng.randint(10, 100) for _ in range(n)]
        ms = [rng.uniform(0.5, 3.0) for _ in range(n)]
        profile = BlockProfile((1, 1), act, ms)
        limit = rng.randint(sum(act) // 3, sum(act))

        def bound(plan):  # kept activations + the largest recomputed block
            return sum(a for i, a in enumerate(act) if i not in plan) + max((act[i] for i in plan), default=0)

        plan = knapsack_plan(profile, limit)
        fitting = [p for k in range(1, n + 1) for p in itertools.combinations(range(n), k) if bound(p) <= limit]
        if fitting:
            assert bound(plan) <= limit and profile.peak_bytes(plan) <= limit
            assert profile.recompute_ms(plan) <= min(profile.recompute_ms(p) for p in fitting) + 1e-9


def test_min_cost_cover():
    assert min_cost_cover([5, 4, 3], [5.0, 1.0, 1.0], 6.5) == (2.0, (1, 2))
    assert min_cost_cover([5, 4, 3], [5.0, 1.5, 1.0], 7.5) == (6.0, (0, 2))
    assert min_cost_cover([1, 1], [1.0, 1.0], 3) is None
    assert min_cost_cover([1], [1.0], 0) == (0.0, ())


def _step(planner, meter, data, seed=7):
    for p in planner.model.parameters():
        p.grad = None
    meter.track(data)
    torch.manual_seed(seed)
    with meter.step() as mem, planner.step(data) as info:
        loss = planner.model(**data).loss
        loss.backward()
    return loss.item(), mem.peak_bytes, info


def _peaks(model, data, plans):
    """Measured peak of one step per plan (the indices of the blocks it recomputes, the others
    kept), without a budget."""
    meter = build_meter("simulated", None)
    planner = build_planner("none", model, None, meter=meter)
    peaks = []
    with meter.activate():
        meter.track(model)
        for plan in plans:
            plan = recomputed(plan, planner.num_blocks)
            planner.policy.decide = lambda size, context, plan=plan: Decision(plan)
            peaks.append(_step(planner, meter, data)[1])
    planner.close()
    return peaks


def test_oracle_plans_the_fewest_blocks_that_fit_and_predicts_the_peak():
    model = tiny_bert(layers=4)
    data = bert_batch(4, 64)
    none_peak, full_peak = _peaks(model, data, [(), (0, 1, 2, 3)])
    budget = int(full_peak + 0.4 * (none_peak - full_peak))
    meter = build_meter("simulated", budget)
    oracle = build_planner("oracle", model, budget, meter=meter)
    with meter.activate():
        meter.track(model)
        loss, peak, info = _step(oracle, meter, data)
        again = _step(oracle, meter, data)[2]
    oracle.close()
    blocks = checkpointed(info.plan)
    assert 0 < len(blocks) < 4 and peak <= budget
    assert abs(peak - info.predicted_peak_bytes) <= 1e-3 * peak
    assert again.cache_hit and again.plan == info.plan and info.excluded_ms > 0
    # the four layers are alike: one time for all, so the plan takes the earliest of them (whose
    # savings last longest in backward), not those that happened to time fastest in the measuring
    fwd_ms = oracle.policy.measured[(4, 64)].blocks["fwd_ms"]
    assert np.all(fwd_ms == fwd_ms[0]) and fwd_ms[0] > 0
    assert info.plan == recompute_first(len(blocks), 4)
    # least recompute: dropping any block of the plan would not fit (blocks cost about the same)
    lighter = [tuple(i for i in blocks if i != drop) for drop in blocks]
    assert all(p > budget for p in _peaks(model, data, lighter))
    # measuring left no trace: the same loss as an unplanned step, bit for bit (its forward runs
    # the same ops in the same order on the same weights)
    free = build_meter("simulated", None)
    plain = build_planner("none", model, None, meter=free)
    with free.activate():
        free.track(model)
        assert _step(plain, free, data)[0] == loss
    plain.close()


def test_only_alike_layers_that_measured_the_same_forward_bytes_share_a_time():
    """``alike_at``: the four alike layers of a tiny BERT measure the same forward bytes and share
    one time; a layer whose forward held other bytes at this size (a pooled stage, a shorter
    sequence) keeps its own, while backward peaks (which differ between identical layers by the
    gradients held) do not split a group."""
    model = tiny_bert(layers=4)
    meter = build_meter("simulated", 10**9)
    oracle = build_planner("oracle", model, 10**9, meter=meter)
    with meter.activate():
        meter.track(model)
        pred = oracle.policy.measure((4, 64), bert_batch(4, 64))
    oracle.close()
    assert len(set(pred.blocks["bwd_peak_bytes"].tolist())) > 1
    assert oracle.policy.alike_at(pred) == {1: 0, 2: 0, 3: 0}
    pred.blocks["plain_bytes"][2] += 4096
    assert oracle.policy.alike_at(pred) == {1: 0, 3: 0}


def test_oracle_without_room_checkpoints_everything_and_says_so():
    model = tiny_bert(layers=3)
    data = bert_batch(4, 64)
    budget = int(0.6 * _peaks(model, data, [(0, 1, 2)])[0])  # not even full checkpointing fits
    meter = build_meter("simulated", budget)
    oracle = build_planner("oracle", model, budget, meter=meter)
    with meter.activate():
        meter.track(model)
        with pytest.warns(UserWarning, match="could not be measured"), pytest.raises(torch.OutOfMemoryError):
            _step(oracle, meter, data)
        assert oracle.last.plan == ("recompute",) * 3 and oracle.policy.measured[(4, 64)] is None
        assert meter.current_bytes() < budget  # the failed measurement freed what it held
    oracle.close()
