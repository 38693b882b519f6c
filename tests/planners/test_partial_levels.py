"""Partial levels (``features.PARTIAL_LEVELS``): a selective checkpoint that keeps only the
outputs of a block's first compute-heavy ops, between ``selective`` and a whole recompute; their
bytes from the probes, their times, plans that take them, and what a saved planner keeps of them."""

import numpy as np
import pytest
import torch
from test_scaling import HELD_OUT, metered_mimose, padded

from mimose_cli.planners.blocks import PARTIAL_LEVELS, checkpointed, plan_levels, plan_of_fields
from mimose_cli.planners.mimose.choices import choice_plan_checked
from mimose_cli.planners.mimose.features import (
    KEPT_SETS,
    PARTIAL_LEVEL,
    RECOMPUTE_LEVEL,
    SELECTIVE_LEVEL,
    TOKENS,
    kept_quantities,
)
from mimose_cli.planners.runners import PlanRunner
from mimose_cli.planners.trial import probe_with_plan

from helpers import bert_batch, tiny_bert


def make(size):
    return padded(bert_batch(*size))


def _prepared(choices="selective"):
    """A prepared Mimose on a 4-layer BERT whose selective and partial recomputes cost only their
    light ops and heavy ops in the time model (no dispatch mode): plans take them where they free
    enough."""
    context = metered_mimose(tiny_bert(4), choices=choices)
    planner, meter = context.__enter__()
    planner.prepare(make, (4, 64))
    planner.policy.choice_times.mode_ms = 0.0
    for p in planner.model.parameters():
        p.grad = None
    return context, planner


def test_each_block_has_partial_levels_that_keep_less_and_less():
    """The probes give every BERT layer partial levels: fewer heavy outputs kept level by level,
    fewer than a selective checkpoint keeps; their predicted bytes fall in that order between
    selective's and none, and their recompute times rise between selective's and a whole
    recompute's (the heavy ops after the kept ones run again)."""
    context, planner = _prepared()
    try:
        runner, policy = planner.parts.plan_runner, planner.policy
        assert planner.stats["partial_levels"] >= 4  # at least one level for each of the 4 layers
        pred = policy.estimator.predict((8, 64))
        recompute_ms, selective_ms = policy.choice_times.at(TOKENS.of((8, 64)))
        partial_ms = policy.choice_times.partial_at(TOKENS.of((8, 64)), selective_ms)
        for i in range(4):
            counts = [runner.partial_keep[i][level] for level in PARTIAL_LEVELS if level in runner.partial_keep[i]]
            assert counts and counts == sorted(counts, reverse=True) and len(set(counts)) == len(counts)
            assert 0 < counts[-1] and counts[0] < runner.selective_keep[i]
            extras = [pred.blocks[kept_quantities(kept_set)[0]][i] for kept_set in KEPT_SETS[:len(counts) + 1]]
            assert all(a > b for a, b in zip(extras, extras[1:])) and extras[-1] > 0, (i, extras)
            times = [selective_ms[i], *partial_ms[i, :len(counts)], recompute_ms[i] + 1e-9]
            assert all(a < b for a, b in zip(times, times[1:])), (i, times)
    finally:
        context.__exit__(None, None, None)


def test_a_partial_plan_fits_its_prediction_and_computes_what_plain_training_does():
    """Every block at each of its partial levels in turn: the measured peak lies between the
    same plan with the blocks recomputed and with them selective, within the prediction (never
    under, within 2 %); the loss and gradients equal plain training's bit for bit: the recompute
    runs the same ops in the same order on the same inputs (torch's selective checkpointing hands
    back the forward's own outputs of the ops it kept, and runs the others again)."""
    context, planner = _prepared()
    try:
        partial_keep = planner.parts.plan_runner.partial_keep
        for size in HELD_OUT:
            batch = make(size)
            selective = probe_with_plan(planner.parts, batch, ("selective",) * 4)
            recomputed = probe_with_plan(planner.parts, batch, ("recompute",) * 4)
            for level in PARTIAL_LEVELS:
                plan = tuple(level if level in partial_keep[i] else "recompute" for i in range(4))
                if level not in plan:
                    continue
                measured = probe_with_plan(planner.parts, batch, plan)
                predicted = planner.predict_peak(size, plan)
                assert recomputed <= measured <= selective, (size, level)
                assert measured <= predicted <= measured * 1.02, (size, level, measured, predicted)

        def step(plan):
            torch.manual_seed(3)
            planner.set_plan(plan)
            with planner.parts.router.using(planner.parts.plan_runner):
                loss = planner.model(**make((4, 40))).loss
                loss.backward()
            grads = [p.grad.clone() for p in planner.model.parameters()]
            planner.model.zero_grad(set_to_none=True)
            return loss.detach(), grads

        planner.set_plan(("keep",) * 4)
        torch.manual_seed(3)
        loss = planner.model(**make((4, 40))).loss
        loss.backward()
        plain = loss.detach(), [p.grad.clone() for p in planner.model.parameters()]
        planner.model.zero_grad(set_to_none=True)
        partial = step(tuple("partial2" if "partial2" in partial_keep[i] else "partial1" for i in range(4)))
        assert torch.equal(partial[0], plain[0])
        assert all(torch.equal(a, b) for a, b in zip(partial[1], plain[1]))
    finally:
        context.__exit__(None, None, None)


def test_plans_take_partial_levels_where_they_fit_best_and_a_saved_planner_keeps_them():
    """With a budget between a plan's partial and selective peaks, Mimose checkpoints a block
    partially: the plan fits and costs less time (in its own model) than the cheapest plan
    without partial levels that fits. A saved planner keeps the levels' counts and its cached
    partial plans."""
    context, planner = _prepared()
    try:
        policy, size = planner.policy, (8, 64)
        partial = tuple("partial2" if "partial2" in planner.parts.plan_runner.partial_keep[i] else "recompute"
                        for i in range(4))
        assert "partial2" in partial
        selective_peak = policy.predict_peak(size, ("selective",) * 4)
        partial_peak = policy.predict_peak(size, partial)
        assert partial_peak < selective_peak
        planner.parts.budget_bytes = (partial_peak + selective_peak) // 2  # no safety margin on the simulated device
        batch = make(size)  # live before the decision, as a training step's batch is
        policy.cache = {}
        decision = policy.decide(size)
        assert set(decision.plan) & set(PARTIAL_LEVELS) and decision.predicted_peak_bytes <= planner.limit_bytes
        measured = probe_with_plan(planner.parts, batch, decision.plan)
        assert measured <= decision.predicted_peak_bytes
        state = planner.state_dict()
    finally:
        context.__exit__(None, None, None)
    with metered_mimose(tiny_bert(4), choices="selective") as (again, meter):
        again.load_state_dict(state)
        assert again.parts.plan_runner.partial_keep == planner.parts.plan_runner.partial_keep
        assert again.policy.cache[size].plan == decision.plan


def test_a_runner_refuses_a_partial_level_the_probes_did_not_find():
    runner = PlanRunner()
    runner.partial_keep = {0: {"partial1": 3}}
    runner.use(runner.checked(("partial1", "recompute"), 2))
    assert (runner.choice(0), runner.choice(1)) == ("partial1", "recompute")
    with pytest.raises(ValueError, match=r"checkpoints blocks \[\(1, 'partial1'\)\] partially, but the probes "
                                         r"found no such level"):
        runner.checked(("recompute", "partial1"), 2)


def test_without_partial_times_no_plan_takes_a_partial_level():
    """A time model without the partial levels' times (an estimator saved before them) plans as
    before: selective or whole, never partial."""
    context, planner = _prepared()
    try:
        planner.policy.choice_times.partial_work = None
        assert planner.stats["partial_levels"] == 0
        pred_every = planner.policy.predict_peak((8, 64), ("recompute",) * 4)
        none = planner.policy.predict_peak((8, 64), ("keep",) * 4)
        planner.parts.budget_bytes = int(pred_every + 0.3 * (none - pred_every))
        planner.policy.cache = {}
        decision = planner.policy.decide((8, 64))
        assert checkpointed(decision.plan) and not set(decision.plan) & set(PARTIAL_LEVELS)
    finally:
        context.__exit__(None, None, None)
    assert np.isfinite(pred_every)


def test_a_block_both_selective_and_partial_is_predicted_as_the_runner_runs_it():
    """The previous release's fields (``blocks.plan_of_fields``): ``selective`` wins over
    ``partial`` for a block given both, and a partial block outside ``plan`` is kept, in the
    prediction's levels as in the runner (a partial level predicted where the runner keeps every
    heavy output would under-predict)."""
    runner = PlanRunner()
    runner.partial_keep = {0: {"partial3": 1}}
    plan = plan_of_fields(2, (0, 1), (0,), (), ((0, "partial3"),))
    runner.use(runner.checked(plan, 2))
    assert (runner.choice(0), runner.choice(1)) == ("selective", "recompute")
    assert plan_levels(plan) == [SELECTIVE_LEVEL, RECOMPUTE_LEVEL]
    outside = plan_of_fields(2, (1,), (), (), ((0, "partial3"), (1, "partial3")))
    assert plan_levels(outside) == [0, PARTIAL_LEVEL["partial3"]]


def test_a_plan_whose_peak_is_not_a_number_never_fits():
    """A level whose predicted peak is NaN (a quantity missing) is never taken as fitting."""
    savings = [np.zeros(2), np.full(2, 5.0), np.full(2, 6.0), np.full(2, 7.0), np.full(2, 8.0), np.full(2, 10.0)]
    costs = [np.zeros(2), np.full(2, 1.0), np.full(2, 1.5), np.full(2, 2.0), np.full(2, 2.5), np.full(2, 4.0)]

    def predict_peaks(levels):
        peaks = 100.0 - np.take([0.0, 5.0, 6.0, 7.0, 8.0, 10.0], levels).sum(axis=-1)
        return np.where((levels == PARTIAL_LEVEL["partial1"]).any(axis=-1), np.nan, peaks)

    plan, peak, fits = choice_plan_checked(savings, costs, predict_peaks, 88.0)
    assert fits and peak <= 88.0 and "partial1" not in plan
