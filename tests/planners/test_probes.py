"""Mimose's probes (planners/mimose/probes.py): one object that runs them and returns what it
found, and the planner that prepares a policy before its first decision."""

import dataclasses

import pytest
import torch
from torch import nn

from mimose_cli.planners import Decision, Planner, Policy
from mimose_cli.planners.blocks import KEEP
from mimose_cli.planners.contract import StepContext
from mimose_cli.planners.inputs import resized_batch
from mimose_cli.planners.mimose.probes import ProbeCounts, Probes

from helpers import bert_batch, tiny_bert
from test_scaling import metered_mimose, padded


def _make(size):
    return padded(bert_batch(*size))


def test_the_probes_return_what_they_found_and_leave_the_policy_as_it_was():
    """``Probes.run`` gives the samples, the inputs let go of, the runner's keeps and its counts in
    one result; the policy's estimator, counters and runner are untouched until it takes them in."""
    with metered_mimose(tiny_bert(2)) as (planner, meter):
        policy = planner.policy
        before = dataclasses.asdict(policy.counts)
        result = Probes(planner.parts, policy.measurer, policy.estimator.feature_set, "block", _make).run((4, 64))
        assert result.samples and not result.fallback and not result.warnings
        assert result.counts.probe_steps == 2 and result.counts.probe_twins == 1 and result.counts.probe_ms > 0
        assert result.releases is not None and policy.estimator.releases is not result.releases
        assert result.timed.selective_keep and result.timed.times is None  # block-level: no times
        assert dataclasses.asdict(policy.counts) == before and not policy.estimator.fitted
        assert planner.parts.plan_runner.selective_keep == {} and policy.needs_prepare


def test_decide_never_probes_the_planner_prepares_the_policy_first():
    """Without ``prepare`` (a loop of one's own) the policy's ``decide`` does not probe: asked
    first, it refuses; the planner's step prepares it from that step's batch, then decides."""
    with metered_mimose(tiny_bert(2)) as (planner, meter):
        batch = bert_batch(2, 16)
        with pytest.raises(AssertionError, match="before prepare"):
            planner.policy.decide((2, 16), StepContext(batch))
        assert planner.stats["probe_steps"] == 0 and planner.policy.needs_prepare
        with planner.step(batch) as info:
            planner.model(**batch).loss.backward()
        assert info.phase == "responsive" and not planner.policy.needs_prepare
        stats = planner.stats
        assert stats["probe_steps"] == 2 and 0 < stats["probe_in_step_ms"] == stats["probe_ms"]
        assert info.planning_ms >= stats["probe_in_step_ms"]  # the probes are in the first step's planning


def test_a_loop_of_ones_own_probes_as_prepare_on_its_first_batch_does():
    """``planner.run`` without ``prepare`` probes from its first batch exactly as ``prepare`` given
    that batch cut to size: the same probe counters, estimate, plans, peaks and losses."""
    batches = [bert_batch(4, 24), bert_batch(2, 40), bert_batch(4, 56)]
    runs = []
    for explicit in (True, False):
        with metered_mimose(tiny_bert(3), budget=1_700_000) as (planner, meter):
            def step_fn(batch):
                loss = planner.model(**batch).loss
                loss.backward()
                return loss.detach()
            if explicit:
                first = batches[0]
                planner.prepare(lambda size: resized_batch(first, size), (4, 24), step_fn=step_fn)
            steps = []
            for batch in batches:
                for p in planner.model.parameters():
                    p.grad = None
                meter.track(batch)
                torch.manual_seed(7)
                with meter.step() as mem:
                    loss = planner.run(step_fn, batch)
                info = planner.last
                steps.append((float(loss), info.plan, info.phase, info.predicted_peak_bytes, mem.peak_bytes))
            stats = planner.stats
            runs.append((steps, {f.name: stats[f.name] for f in dataclasses.fields(ProbeCounts)
                                 if f.name != "probe_ms"}, stats["probe_samples"], stats["probe_in_step_ms"]))
    (prepared, prepared_counts, prepared_samples, prepared_in_step), (own, own_counts, own_samples, own_in_step) = runs
    assert own_counts == prepared_counts and own_counts["probe_steps"] == 2
    assert own_samples == prepared_samples > 0
    assert own == prepared and any(plan for _, plan, *_ in own)  # the budget has blocks checkpointed
    assert prepared_in_step == 0 < own_in_step


class _Prepared(Policy):
    """A policy that needs ``prepare`` and records how it was called."""

    name = "prepared"
    needs_prepare = True

    def __init__(self, parts):
        super().__init__(parts)
        self.calls = []

    def prepare(self, make_batch, max_input_size, reserve_bytes=0, step_fn=None):
        self.calls.append(("prepare", tuple(make_batch((2, 4))["input_ids"].shape), max_input_size, step_fn))
        self.needs_prepare = False

    def decide(self, input_size, context):
        self.calls.append(("decide", input_size))
        return Decision((KEEP,) * self.parts.num_blocks)


def test_any_policy_that_needs_prepare_is_prepared_once_before_its_first_decision():
    """The planner, not the policy, prepares a policy the loop did not (``Policy.prepare_from``):
    once, before the first ``decide``, from that step's batch cut to a size; a step without a
    batch to cut leaves it to the policy (the default prepares nothing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    batch = {"input_ids": torch.randint(0, 4, (3, 6))}
    with Planner(model, _Prepared, blocks="*") as planner:
        def step_fn(b):
            return None
        planner.run(step_fn, batch, input_size=(3, 6))
        planner.run(step_fn, batch, input_size=(3, 6))
        assert planner.policy.calls == [("prepare", (2, 4), (3, 6), step_fn), ("decide", (3, 6)), ("decide", (3, 6))]
    with Planner(model, _Prepared, blocks="*") as planner:
        with planner.step(input_size=(3, 6)):
            pass
        assert planner.policy.calls == [("decide", (3, 6))] and planner.policy.needs_prepare
