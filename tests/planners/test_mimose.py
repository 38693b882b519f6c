import copy

import pytest
import torch

import mimose_cli
from mimose_cli.memory import build_meter
from mimose_cli.planners import PLANNERS, build_planner
from mimose_cli.planners.baselines.uniform import NoCheckpointing
from mimose_cli.planners.blocks import checkpointed
from mimose_cli.planners.mimose.collector import drop_reason
from mimose_cli.planners.mimose.policy import UNSEEN_SHARE, Mimose, MimosePolicy

from helpers import assert_tensors_close, bert_batch, fitted_mimose, run_step, tiny_bert


def test_registered_and_exported():
    assert PLANNERS["mimose"] is MimosePolicy and mimose_cli.Mimose is Mimose
    with Mimose(tiny_bert(), "1GB", granularity=8) as planner:
        assert isinstance(planner.policy, MimosePolicy) and planner.policy.granularity == 8


def test_sheltered_phase_fits_a_budget_none_cannot_and_matches_none():
    data = bert_batch(4, 96)
    reference = tiny_bert()
    sheltered = copy.deepcopy(reference)
    free = build_meter("simulated", None)
    with free.activate():
        free.track(reference)
        none = NoCheckpointing(reference, meter=free)
        none_loss, none_peak, _ = run_step(none, free, data)
        none_grads = [p.grad.clone() for p in reference.parameters()]
        none.close()
    budget = int(none_peak * 0.7)
    meter = build_meter("simulated", budget)
    with meter.activate():
        meter.track(sheltered)
        with pytest.raises(torch.OutOfMemoryError):  # the budget binds: none does not fit
            failing = NoCheckpointing(sheltered, meter=meter)
            try:
                run_step(failing, meter, data)
            finally:
                failing.close()
        planner = Mimose(sheltered, budget, meter=meter, estimate="sheltered")
        loss, peak, info = run_step(planner, meter, data)
        planner.close()
    assert info.phase == "sheltered" and info.plan == ("recompute",) * 3
    assert peak <= budget
    assert torch.equal(loss, none_loss)  # the forward kept runs the same ops in the same order
    assert_tensors_close(none_grads, [p.grad for p in sheltered.parameters()], "gradient")


def test_sheltered_samples_are_measured_for_every_block(sheltered):
    blocks, step = sheltered.samples[0]
    assert all(blocks[q][i] is not None for q in ("saved_bytes", "plain_bytes", "bwd_peak_bytes") for i in range(3))
    assert step["head_peak_bytes"] is not None and step["tail_peak_bytes"] is not None
    assert blocks["plain_bytes"][0][0] > blocks["ckpt_bytes"][0][0] > 0
    assert len(sheltered.samples) == sheltered.stats["sheltered_iterations"] == len(sheltered.sizes)
    assert sheltered.stats["phase"] == "responsive" and sheltered.state["estimator"]["fitted"] is not None


@pytest.mark.parametrize("name, checkpointed, parents, children, calls, inside, reason", [
    ("layer.1", set(), ["layer"], ["layer.1.attn"], 0, False, None),
    ("layer.1", {"layer.1"}, ["layer"], [], 0, False, "checkpointed"),
    ("layer.1", set(), ["layer"], [], 0, True, "checkpointed"),
    ("layer.1", {"layer"}, ["layer"], [], 0, False, "parent_checkpointed"),
    ("layer.1", {"layer.1.attn"}, ["layer"], ["layer.1.attn"], 0, False, "child_checkpointed"),
    ("layer.1", {"layer.2"}, ["layer"], ["layer.1.attn"], 0, False, None),  # a sibling is not a parent
    ("layer.1", set(), [], [], 1, False, "called_twice"),
])
def test_drop_reason_applies_the_papers_rules(name, checkpointed, parents, children, calls, inside, reason):
    assert drop_reason(name, checkpointed, parents, children, calls=calls, in_checkpoint=inside) == reason


def test_data_filter_drops_blocks_whose_child_or_parent_is_checkpointed():
    model = tiny_bert()
    model.bert.encoder.layer[1].attention.gradient_checkpointing = True  # a child of block 1
    meter = build_meter("simulated", None)
    with meter.activate():
        meter.track(model)
        planner = Mimose(model, "1GB", meter=meter, estimate="sheltered", sheltered_steps=5)
        run_step(planner, meter, bert_batch(2, 16))
        model.bert.encoder.gradient_checkpointing = True  # the parent of every block
        run_step(planner, meter, bert_batch(2, 24))
        planner.close()
    first = planner.policy.estimator.samples[0][0]
    for q in ("saved_bytes", "plain_bytes", "fwd_peak_bytes", "bwd_peak_bytes"):
        assert first[q][0] is not None and first[q][1] is None and first[q][2] is not None
    assert len(planner.policy.estimator.samples) == 1  # the second step measured nothing usable
    assert planner.stats["sheltered_iterations"] == 1


def test_data_filter_drops_blocks_run_inside_a_user_checkpoint():
    model = tiny_bert()
    meter = build_meter("simulated", None)
    with meter.activate():
        meter.track(model)
        planner = Mimose(model, "1GB", meter=meter, estimate="sheltered", sheltered_steps=5)
        data = bert_batch(2, 16)
        with planner.step(data):
            loss = torch.utils.checkpoint.checkpoint(lambda ids: model(input_ids=ids, labels=data["labels"]).loss,
                                                     data["input_ids"], use_reentrant=False)
            loss.backward()
        planner.close()
    assert planner.policy.estimator.samples == [] and planner.policy.sheltered


def test_responsive_plan_is_empty_when_everything_fits(fitted):
    planner, meter = fitted
    _, peak, info = run_step(planner, meter, bert_batch(4, 64))
    assert info.phase == "responsive" and info.plan == ("keep",) * 3 and info.cache_hit is False
    assert peak <= info.predicted_peak_bytes


def test_responsive_plan_checkpoints_blocks_when_the_budget_binds(sheltered):
    data = bert_batch(4, 120)
    with fitted_mimose(sheltered.state) as (planner, meter):
        _, none_peak, free = run_step(planner, meter, data)
    budget = int(0.8 * none_peak)
    with fitted_mimose(sheltered.state, budget) as (bound, tight):
        _, peak, info = run_step(bound, tight, data)
    assert free.plan == ("keep",) * 3 and checkpointed(info.plan)[:1] == (0,)  # earliest blocks first
    assert peak <= budget and peak <= info.predicted_peak_bytes <= budget


def test_default_cache_key_is_the_exact_size(fitted):
    planner, _ = fitted
    assert planner.policy.granularity == 1 and planner.policy.cache_key((4, 38)) == (4, 38)


def test_same_rounded_size_hits_the_plan_cache(sheltered):
    with fitted_mimose(sheltered.state, granularity=8) as (planner, meter):
        _, _, first = run_step(planner, meter, bert_batch(4, 33))
        _, _, second = run_step(planner, meter, bert_batch(4, 38))
        _, _, third = run_step(planner, meter, bert_batch(4, 41))
        stats = planner.stats
    assert (first.cache_hit, second.cache_hit, third.cache_hit) == (False, True, False)
    assert planner.policy.cache_key((4, 38)) == (4, 40)
    assert stats["hits"] == 1 and stats["misses"] == 2 and stats["hit_rate"] == pytest.approx(1 / 3)


def test_save_load_round_trip_skips_the_sheltered_phase(fitted, tmp_path):
    planner, meter = fitted
    _, _, info = run_step(planner, meter, bert_batch(4, 50))
    planner.save(tmp_path / "estimator.json")
    planner.close()
    loaded = Mimose(planner.model, "1GB", meter=meter).load(tmp_path / "estimator.json")
    _, _, again = run_step(loaded, meter, bert_batch(4, 50))
    loaded.close()
    assert again.phase == "responsive" and again.cache_hit and again.plan == info.plan
    expected = planner.policy.estimator.predict((3, 70)).step
    assert loaded.policy.estimator.predict((3, 70)).step == pytest.approx(expected)


def test_library_api_builds_its_own_meter_and_enforces_the_budget():
    model = tiny_bert()
    planner = mimose_cli.Mimose(model, budget="1GB", estimate="sheltered", sheltered_steps=2)
    try:
        phases = []
        for size in [(2, 16), (2, 32), (2, 24), (2, 40)]:
            with planner.step(bert_batch(*size)) as info:
                model(**bert_batch(*size)).loss.backward()
            phases.append(info.phase)
        # Two lengths do not determine the constant term: the third is measured, not guessed.
        assert phases == ["sheltered", "sheltered", "measuring", "responsive"]
        assert planner.meter.peak_bytes() > 0
    finally:
        planner.close()


def test_build_planner_accepts_the_loops_keywords():
    model = tiny_bert()
    meter = build_meter("simulated", None)
    planner = build_planner("mimose", model, "1GB", blocks=None, safety_margin="1MB", meter=meter,
                            sheltered_steps=3, granularity=16)
    assert planner.limit_bytes == 10**9 - 10**6 and planner.policy.granularity == 16
    planner.close()
    with pytest.raises(ValueError, match="granularity"):
        Mimose(model, "1GB", meter=meter, granularity=0)


def test_every_counter_is_in_stats_and_survives_a_state_dict(sheltered):
    from dataclasses import fields

    from mimose_cli.planners.mimose.policy import MimoseCounters

    with fitted_mimose(sheltered.state) as (planner, meter):
        run_step(planner, meter, bert_batch(3, 30))  # a planned step: a miss, a responsive step
        state, stats = planner.state_dict(), planner.stats
        with fitted_mimose(state) as (loaded, _):
            restored = loaded.stats
    names = [f.name for f in fields(MimoseCounters)]
    assert stats["sheltered_iterations"] == len(sheltered.sizes) and stats["misses"] == 1
    assert stats["responsive_steps"] == 1
    assert {name: restored[name] for name in names} == {name: stats[name] for name in names}


def test_a_state_saved_before_the_counters_dataclass_keeps_its_counters(sheltered):
    with fitted_mimose(sheltered.state) as (planner, meter):
        run_step(planner, meter, bert_batch(3, 30))
        state, stats = planner.state_dict(), planner.stats
    counters = state.pop("counters")
    renamed = {"sheltered_iterations": "sheltered_done", "estimator_fit_ms": "fit_ms",
               "untrusted_steps": "untrusted", "measuring_steps": "measuring"}
    top = ("sheltered_iterations", "sheltered_attempts", "estimator_fit_ms", "untrusted_reasons", "warnings")
    state.update({renamed.get(k, k): counters[k] for k in top})
    state["counts"] = {renamed.get(k, k): v for k, v in counters.items() if k not in top}
    with fitted_mimose(state) as (earlier, _):
        assert {k: earlier.stats[k] for k in counters} == {k: stats[k] for k in counters}
    state["counts"]["bogus"] = 1
    with pytest.raises(ValueError, match="counts bogus"):
        with fitted_mimose(state):
            pass


def test_a_small_shortfall_is_added_to_every_prediction_not_measured(sheltered, monkeypatch):
    """On a GPU a kernel's scratch memory is seen by the allocator, not by the probes' per-op
    timeline: a planned step that peaks a little (<= UNSEEN_SHARE of the limit) above its
    prediction is not measured again (that cannot show those bytes); the bytes are added to every
    prediction since, and the plans cached without them are planned again."""
    with fitted_mimose(sheltered.state, "20MB") as (planner, meter):
        honest = planner.policy._margined
        hidden = int(0.01 * planner.parts.limit_bytes)
        monkeypatch.setattr(planner.policy, "_margined", lambda peak: honest(peak) - hidden)
        batch = bert_batch(3, 30)
        _, peak, info = run_step(planner, meter, batch)
        under = peak - info.predicted_peak_bytes
        assert info.phase == "responsive" and 0 < under <= hidden
        assert planner.stats["unseen_bytes"] == under and not planner.policy.cache
        monkeypatch.setattr(planner.policy, "_margined", honest)
        _, again_peak, again = run_step(planner, meter, batch)
        assert again.phase == "responsive" and not again.cache_hit
        assert again.predicted_peak_bytes >= info.predicted_peak_bytes + hidden + under
        assert again_peak <= again.predicted_peak_bytes and planner.stats["measuring_steps"] == 0


def test_under_fsdp_a_shortfall_within_a_collectives_buffer_is_not_added(sheltered, monkeypatch):
    """Under FSDP a step's peak moves by up to one unit's gathered parameters with the moment the
    collectives' worker lets go of a buffer (``PlannerParts.collective_jitter_bytes``, which the
    safety margin keeps free on the simulated device): a shortfall within it says nothing about
    bytes the probes missed and is not carried into every prediction; a larger one is, whole."""
    with fitted_mimose(sheltered.state, "20MB") as (planner, meter):
        honest = planner.policy._margined
        hidden = int(0.01 * planner.parts.limit_bytes)
        monkeypatch.setattr(planner.policy, "_margined", lambda peak: honest(peak) - hidden)
        planner.parts.collective_jitter_bytes = hidden  # as a sharded model's largest unit would give
        _, peak, info = run_step(planner, meter, bert_batch(3, 30))
        assert 0 < peak - info.predicted_peak_bytes <= hidden and planner.stats["unseen_bytes"] == 0
        planner.parts.collective_jitter_bytes = hidden // 4
        _, peak, info = run_step(planner, meter, bert_batch(3, 31))
        assert planner.stats["unseen_bytes"] == peak - info.predicted_peak_bytes > hidden // 4
        # Only as far as the safety margin keeps room for it: with none, every shortfall is carried.
        planner.parts.collective_jitter_bytes, planner.parts._safety_margin = hidden, 0
        before = planner.stats["unseen_bytes"]
        _, peak, info = run_step(planner, meter, bert_batch(3, 26))
        assert planner.stats["unseen_bytes"] == before + peak - info.predicted_peak_bytes > before


def test_a_step_that_peaks_above_its_prediction_has_its_size_measured_again(sheltered, monkeypatch):
    with fitted_mimose(sheltered.state, "20MB") as (planner, meter):
        honest = planner.policy._margined
        # Short by more than UNSEEN_SHARE of the limit: the fit is wrong at this size.
        short = 2 * UNSEEN_SHARE * planner.parts.limit_bytes
        monkeypatch.setattr(planner.policy, "_margined", lambda peak: honest(peak) - short)
        batch = bert_batch(3, 30)
        _, peak, info = run_step(planner, meter, batch)
        assert info.phase == "responsive" and peak > info.predicted_peak_bytes
        monkeypatch.setattr(planner.policy, "_margined", honest)
        samples = len(planner.policy.estimator.sizes)
        _, _, again = run_step(planner, meter, batch)  # not the cached plan: measured, and refit
        assert again.phase == "measuring" and len(planner.policy.estimator.sizes) == samples + 1
        assert any("peaked above its prediction" in r for r in planner.stats["untrusted_reasons"])
        _, peak, after = run_step(planner, meter, batch)
        assert after.phase == "responsive" and peak <= after.predicted_peak_bytes
        assert planner.stats["underpredictions"] == 1


def test_a_distrusted_size_is_measured_before_it_is_planned_again(sheltered):
    """A resumed run distrusts the sizes that ran out of memory before (launcher/failures.py's
    out_of_memory.jsonl): their next step is measured, the ones after are planned."""
    with fitted_mimose(sheltered.state, "20MB") as (planner, meter):
        batch = bert_batch(3, 30)
        assert run_step(planner, meter, batch)[2].phase == "responsive"
        planner.policy.distrust((3, 30))
        assert run_step(planner, meter, batch)[2].phase == "measuring"
        assert run_step(planner, meter, batch)[2].phase == "responsive"
