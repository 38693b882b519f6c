"""Offload as one of Mimose's and the oracle's choices (``choices: offload``): a block freed whole
is offloaded where its copies, timed on this device, cost less than its recompute; its device
bytes are bounded by the same block recomputed, so plans stay within their predictions."""

import numpy as np
import pytest
import torch
from test_choices import make
from test_scaling import HELD_OUT, metered_mimose

from mimose_cli.memory import build_meter
from mimose_cli.memory.offload import OFFLOAD_MIN_BYTES
from mimose_cli.planners import Mimose, build_planner
from mimose_cli.planners.blocks import OFFLOAD, RECOMPUTE, checkpointed, offloading, recomputed
from mimose_cli.planners.mimose.choices import ChoiceTimes, bounded_for_offload, copy_costs_ms, freeing_ms
from mimose_cli.planners.mimose.estimator import Timeline, plan_peak_bytes
from mimose_cli.planners.mimose.features import TOKENS
from mimose_cli.planners.trial import probe_with_plan

from helpers import bert_batch, tiny_bert


def _middle_budget(planner, batch) -> int:
    """Halfway between every block recomputed and none, for ``batch``, on this planner's device."""
    n = planner.parts.num_blocks
    none_peak = probe_with_plan(planner.parts, batch, recomputed((), n))
    full_peak = probe_with_plan(planner.parts, batch, recomputed(range(n), n))
    return int(full_peak + 0.5 * (none_peak - full_peak))


def test_mimose_offloads_where_the_copies_cost_less_and_its_predictions_bound_the_steps():
    """At a middle budget every block the plan frees whole is offloaded exactly where the copies'
    modelled ms are below its recompute's; the step's measured peak is within the prediction and
    no more than the same plan with those blocks recomputed (the bound the scheduler relies on).
    With the copies made dear, nothing is offloaded and the plans still fit."""
    with metered_mimose(tiny_bert(4), choices="offload") as (planner, meter):
        planner.prepare(make, (4, 64))
        policy = planner.policy
        times = policy.choice_times
        assert policy._offload_known() and planner.stats["offload_in_use"] is True
        assert times.copy_ms[0] >= 0 and times.copy_ms[1] > 0 and (times.storages > 0).all()
        # Copies priced below a recompute, whatever this machine timed (a loaded CPU can time a
        # memcpy slow), so that plans offload; the pricing itself is checked below either way.
        times.copy_ms = (0.0, times.copy_ms[1] * 1e-3)
        for p in planner.model.parameters():
            p.grad = None
        offloaded = 0
        for size in HELD_OUT:
            batch = make(size)
            planner.parts.budget_bytes = _middle_budget(planner, batch)
            policy.cache = {}
            decision = policy.decide(size)
            pred = policy.estimator.predict(policy.cache_key(size))
            recompute_ms, _ = times.at(TOKENS.of(size))
            offload_ms = times.offload_at(pred.blocks["saved_bytes"])
            offload = {i for i, choice in enumerate(decision.plan) if choice == OFFLOAD}
            freed = offload | {i for i, choice in enumerate(decision.plan) if choice == RECOMPUTE}
            assert offload == {i for i in freed if offload_ms[i] < recompute_ms[i]}, (size, decision)
            freed_plan = tuple(RECOMPUTE if choice == OFFLOAD else choice for choice in decision.plan)
            measured = probe_with_plan(planner.parts, batch, decision.plan)
            recomputed_peak = probe_with_plan(planner.parts, batch, freed_plan)
            assert measured <= recomputed_peak <= decision.predicted_peak_bytes <= planner.limit_bytes, (size, decision)
            # the prediction carries the small storages an offloaded block keeps
            # (``bounded_for_offload``): above the same plan predicted recomputed
            as_planned = policy.predict_peak(size, decision.plan)
            assert as_planned == decision.predicted_peak_bytes
            if offload:
                assert policy.predict_peak(size, freed_plan) < as_planned
            offloaded += len(offload)
        assert offloaded  # the copies cost less than some recompute here
        times.copy_ms = (1e3, 0.0)  # a second per storage: never worth it
        policy.cache = {}
        decision = policy.decide(HELD_OUT[-1])  # the last size, at its middle budget
        assert OFFLOAD not in decision.plan and checkpointed(decision.plan)
        assert decision.predicted_peak_bytes <= planner.limit_bytes


def test_the_scheduler_frees_a_block_whole_at_the_cheaper_of_its_recompute_and_offload():
    recompute = np.array([2.0, 1.0, 3.0])
    ms, offloaded = freeing_ms(recompute, np.array([1.0, 1.5, 3.0]))
    assert ms.tolist() == [1.0, 1.0, 3.0] and offloaded.tolist() == [True, False, False]
    assert freeing_ms(recompute, None)[1].tolist() == [False, False, False]
    # a selective block is never offloaded; the others freed whole and offloaded leave the plan
    assert offloading(("selective", "recompute", "recompute"), np.array([True, True, False])) == (
        "selective", "offload", "recompute")


def test_an_offloaded_block_is_bounded_with_the_small_storages_it_keeps_on_the_device():
    """``bounded_for_offload``: an offloaded block may keep each storage it saves under
    ``OFFLOAD_MIN_BYTES`` on the device from its forward to its backward, where a checkpoint keeps
    none: its checkpointed bytes and forward peak are raised by that much, the other blocks' and
    the prediction handed in are not, and a plan freeing it is predicted that much higher."""
    with metered_mimose(tiny_bert(4), choices="offload") as (planner, meter):
        planner.prepare(make, (4, 64))
        pred = planner.policy.estimator.predict((4, 64))
        storages = planner.policy.choice_times.storages
    before = {q: v.copy() for q, v in pred.blocks.items()}
    offloaded = np.array([False, True, False, True])
    bounded = bounded_for_offload(pred, offloaded, storages)
    kept = storages * (OFFLOAD_MIN_BYTES - 1)
    for quantity in ("ckpt_bytes", "ckpt_fwd_peak_bytes"):
        assert bounded.blocks[quantity] - before[quantity] == pytest.approx(np.where(offloaded, kept, 0.0))
        assert (pred.blocks[quantity] == before[quantity]).all()
    assert bounded.savings == pytest.approx(pred.savings - np.where(offloaded, kept, 0.0))
    # Every block recomputed, event by event (before the blocks, the four forwards, the head, the
    # four backwards, the tail): from block 1's forward on, its storages are held until its
    # backward, and block 3's likewise; a block's own backward starts above what the blocks before
    # it hold, so only blocks 2 and 3's backwards see block 1's.
    every = np.ones(4, dtype=bool)
    raised = Timeline(bounded).events(every) - Timeline(pred).events(every)
    k1, k3 = kept[1], kept[3]
    assert raised == pytest.approx([0, 0, k1, k1, k1 + k3, k1 + k3, 0, 0, k1, k1, 0], abs=1e-6)
    assert plan_peak_bytes(bounded, (RECOMPUTE,) * 4) > plan_peak_bytes(pred, (RECOMPUTE,) * 4)
    assert bounded_for_offload(pred, np.zeros(4, dtype=bool), storages) is pred


def test_offload_times_survive_a_save_and_a_state_saved_before_them_offloads_nothing():
    times = ChoiceTimes(np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((2, 6)), np.zeros((2, 6)), np.ones(2),
                        np.ones(2), 0.01, 0.02, storages=np.array([3.0, 5.0]), copy_ms=(0.1, 1e-6))
    assert times.offload_at(np.array([1e6, -5.0])) == pytest.approx([3 * 0.12 + 1.0, 5 * 0.12])
    again = ChoiceTimes.from_state(times.state_dict(), TOKENS)
    assert again.offload_at(np.array([1e6, 0.0])) == pytest.approx(times.offload_at(np.array([1e6, 0.0])))
    older = {k: v for k, v in times.state_dict().items() if k not in ("storages", "copy_ms")}
    assert ChoiceTimes.from_state(older, TOKENS).offload_at(np.array([1e6, 0.0])) is None


def test_the_copies_are_timed_off_the_budget_and_leave_the_meter_as_it_was():
    """The copies are timed on storages of up to 8 MiB: on a 1 MiB simulated device that is the
    planner's own work, not an out-of-memory step, and the device's bytes and peak are unchanged."""
    model = tiny_bert(2)
    meter = build_meter("simulated", 2**20)
    with meter.activate():
        meter.track(model)
        planner = Mimose(model, 2**20, meter=meter, choices="offload")
        before = meter.current_bytes(), meter.peak_bytes()
        committed = []
        commit = meter._ledger.commit
        meter._ledger.commit = lambda added: (committed.append(added), commit(added))[1]
        try:
            per_storage, per_byte = planner.parts.timed_off_budget(copy_costs_ms)
        finally:
            meter._ledger.commit = commit
        assert committed == []  # the device's meter never saw the copies
        assert (meter.current_bytes(), meter.peak_bytes()) == before
        planner.close()
    assert per_storage >= 0 and per_byte > 0


def test_a_saved_planner_keeps_its_offloaded_plans():
    with metered_mimose(tiny_bert(4), choices="offload") as (planner, meter):
        planner.prepare(make, (4, 64))
        planner.policy.choice_times.copy_ms = (0.0, 1e-9)  # cheaper than any recompute: plans offload
        planner.parts.budget_bytes = _middle_budget(planner, make((8, 64)))
        decision = planner.policy.decide((8, 64))
        state = planner.state_dict()
    assert OFFLOAD in decision.plan
    with metered_mimose(tiny_bert(4), choices="offload") as (again, meter):
        again.load_state_dict(state)
        assert again.policy.cache[(8, 64)].plan == decision.plan
        assert again.policy.choice_times.copy_ms == planner.policy.choice_times.copy_ms


def test_the_oracle_searches_offload_too_and_computes_the_plain_step():
    """``oracle`` with ``choices="offload"`` at a middle budget offloads blocks; the step fits
    within its prediction, and its loss and gradients are plain training's bit for bit: an
    offloaded block runs the same ops in the same order, and backward reads byte-exact copies."""
    batch = bert_batch(4, 64)

    def step(planner, meter, model):
        torch.manual_seed(1)  # the same dropout masks in both steps
        with meter.activate():
            meter.track(model, batch)
            loss = planner.run(lambda b: _backward(model, b), batch)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return loss, grads, planner.last

    model = tiny_bert(4)
    free = build_meter("simulated", None)
    plain = build_planner("none", model, None, meter=free)
    plain_loss, plain_grads, _ = step(plain, free, model)
    plain.close()
    probe = build_planner("none", model, None, meter=build_meter("simulated", None))
    with probe.meter.activate():
        probe.meter.track(model)
        budget = _middle_budget(probe, batch)
    probe.close()
    model.zero_grad(set_to_none=True)
    meter = build_meter("simulated", budget)
    oracle = build_planner("oracle", model, budget, meter=meter, choices="offload")
    oracle.policy._copy_costs = (0.0, 1e-9)  # cheaper than any recompute, whatever this machine times
    loss, grads, info = step(oracle, meter, model)
    oracle.close()
    assert OFFLOAD in info.plan
    assert meter.peak_bytes() <= info.predicted_peak_bytes <= budget
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def _backward(model, batch):
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def test_an_estimator_saved_without_copy_costs_offloads_nothing_and_says_so():
    """A state saved by ``choices: selective`` loaded with ``choices: offload``: no copy costs, so
    one warning says no block is offloaded and how to probe again; plans still fit, none offloads."""
    with metered_mimose(tiny_bert(4), choices="selective") as (planner, meter):
        planner.prepare(make, (4, 64))
        state = planner.state_dict()
    with metered_mimose(tiny_bert(4), choices="offload") as (planner, meter):
        with pytest.warns(UserWarning, match=r"no block is offloaded .* no copy costs .* estimator.json aside"):
            planner.load_state_dict(state)
        assert planner.stats["offload_in_use"] is False
        planner.parts.budget_bytes = _middle_budget(planner, make((8, 64)))
        decision = planner.policy.decide((8, 64))
        assert checkpointed(decision.plan) and OFFLOAD not in decision.plan


def test_a_storage_still_held_elsewhere_comes_back_as_itself_not_as_a_second_copy():
    """Block 1 ends in a ReLU, which saves its output; block 2 saves that output as its input. With
    block 2 offloaded, backward must hand block 2 the storage block 1 still holds, not a copy beside
    it: the step's peak is then no higher than with block 2 recomputed, the bound Mimose predicts
    offloads with (a second copy held it 2 MB higher here), and the gradients are the same (float
    tolerance: a recompute's matmul and the forward's need not round alike)."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(256, 256), nn.Sequential(nn.Linear(256, 256), nn.ReLU()),
                          nn.Sequential(nn.Linear(256, 128)), nn.Linear(128, 1))
    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(1))

    def step_fn(batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        return loss.detach()

    meter = build_meter("simulated", None)
    with meter.activate():
        meter.track(model, x)
        planner = build_planner("none", model, None, meter=meter, blocks="[12]")  # block 1: module "2"
        choices = {"recomputed": ("keep", "recompute"), "offloaded": ("keep", "offload")}
        peaks, grads = {}, {}
        for name, plan in choices.items():
            peaks[name] = probe_with_plan(planner.parts, x, plan, step_fn)
            model.zero_grad(set_to_none=True)
        for name, plan in choices.items():
            planner.parts.set_plan(plan)
            with planner.parts.router.using(planner.parts.plan_runner):
                step_fn(x)
            grads[name] = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
        planner.close()
    assert peaks["offloaded"] <= peaks["recomputed"], peaks
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads["offloaded"], grads["recomputed"]))


def test_finer_choices_without_the_probes_are_refused_in_one_line():
    """Only the probes measure what a block holds checkpointed selectively and what it saves: a
    sheltered estimate with finer choices would plan block-level without a word, so it is refused."""
    for choices in ("selective", "offload"):
        with pytest.raises(ValueError, match=r"^choices='\w+' is invalid; expected block with estimate: sheltered .*; set estimate: probes or "
                                             r"choices: block$"):
            Mimose(tiny_bert(2), "1GB", meter=build_meter("simulated", None), estimate="sheltered", choices=choices)
