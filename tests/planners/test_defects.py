"""Three defects of the planner's step, each shown by a test that failed on the code before:
a cached plan spending a recovery's margin, a policy asked to decide a step it does not plan,
and a runner's begin that raised leaving what it had entered."""

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import mimose_cli.planners.mimose.collector as collector
from mimose_cli.memory import build_meter
from mimose_cli.planners import Decision, Planner, Policy
from mimose_cli.planners.blocks import KEEP, RECOMPUTE, checkpointed
from mimose_cli.planners.mimose.policy import Mimose

from helpers import bert_batch, fitted_mimose, run_step, tiny_bert


def test_a_cached_plan_keeps_the_margin_a_recovery_set(sheltered):
    """A miss plans inside the limit less the margin a recovery set for that size; a hit must hold
    inside the same limit, or a step starting higher than the cached one spends the margin."""
    data = bert_batch(4, 120)
    with fitted_mimose(sheltered.state) as (planner, meter):
        _, plain_peak, _ = run_step(planner, meter, data)
    with fitted_mimose(sheltered.state, int(0.8 * plain_peak)) as (planner, meter):
        _, _, first = run_step(planner, meter, data)
        key = planner.policy.cache_key(data["input_ids"].shape)
        # The margin a recovery at this size would have left, a byte more than the cached plan's room.
        margin = planner.limit_bytes - first.predicted_peak_bytes + 1
        planner.policy.recovery_margins[key] = margin
        _, peak, second = run_step(planner, meter, data)
    assert first.cache_hit is False and second.cache_hit is False
    assert second.predicted_peak_bytes <= planner.limit_bytes - margin
    assert len(checkpointed(second.plan)) > len(checkpointed(first.plan)) and peak <= second.predicted_peak_bytes


class CountingPolicy(Policy):
    """Keeps every block and counts what it was asked."""

    name = "counting"

    def __init__(self, parts):
        super().__init__(parts)
        self.asked: list = []

    def decide(self, input_size, context):
        self.asked.append(tuple(input_size))
        return Decision((KEEP,) * self.parts.num_blocks, "kept")


def test_a_size_checkpointed_for_good_is_not_decided_by_the_policy():
    """Once recovery checkpoints every block for a size (``Planner.full_sizes``), the policy is not
    asked about that size: its counts, warnings and measurements are for steps it plans."""
    model = tiny_bert()
    meter = build_meter("simulated", None)
    with meter.activate(), Planner(model, CountingPolicy, meter=meter) as planner:
        meter.track(model)
        planner.full_sizes.add((2, 16))
        _, _, recovered = run_step(planner, meter, bert_batch(2, 16))
        _, _, planned = run_step(planner, meter, bert_batch(2, 24))
    assert recovered.phase == "recovery" and recovered.plan == (RECOMPUTE,) * planner.num_blocks
    assert planned.phase == "kept" and planned.plan == (KEEP,) * planner.num_blocks
    assert planner.policy.asked == [(2, 24)]


def test_a_runner_whose_begin_raises_leaves_what_it_entered(sheltered, monkeypatch):
    """The collector enters its per-op probe (a dispatch mode) at the start of ``begin``; when the
    rest of ``begin`` raises, the step's ``abort`` must leave it, or every later op runs under it."""
    def broken(*args, **kwargs):
        raise RuntimeError("the saved-bytes counter could not start")

    monkeypatch.setattr(collector, "SavedBytesCounter", broken)
    model = tiny_bert()
    meter = build_meter("simulated", 10**9)
    with meter.activate():
        meter.track(model)
        modes_before = len(_get_current_dispatch_mode_stack())
        planner = Mimose(model, "1GB", meter=meter, estimate="sheltered", sheltered_steps=2)
        try:
            with pytest.raises(RuntimeError, match="saved-bytes counter"):
                run_step(planner, meter, bert_batch(2, 16))
            assert len(_get_current_dispatch_mode_stack()) == modes_before
            assert planner.policy.measurer.active is False
        finally:
            planner.close()
    assert torch.ones(2).sum().item() == 2.0
