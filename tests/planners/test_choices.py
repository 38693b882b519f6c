"""Finer plans (``planner.mimose.choices: selective``): each block kept, checkpointed selectively or
recomputed; the selective bytes from the probes, the scheduler over the three choices, the plan
as the step ran it in records."""

import math
import random

import numpy as np
import pytest
import torch
from plan_fields import fields
from test_oracle import random_prediction
from test_scaling import HELD_OUT, metered_mimose, padded

from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.planners.blocks import PARTIAL_LEVELS
from mimose_cli.planners.blocks import plan_of_fields, plan_of_levels, recomputed
from mimose_cli.planners.mimose.choices import ChoiceTimes, choice_plan_checked
from mimose_cli.planners.mimose.estimator import Timeline, plan_peak_bytes
from mimose_cli.planners.mimose.features import KEPT_SETS, LEVELS, TOKENS
from mimose_cli.planners.trial import probe_step, probe_with_plan
from mimose_cli.runs.plots import plan_figure
from mimose_cli.runs.records import StepRecord

from helpers import bert_batch, run_step, tiny_bert

QUICKSTART = "recipes/quickstart.yaml"


def make(size):
    return padded(bert_batch(*size))


def plan_of(level: list) -> tuple:
    """``fields`` of the plan of ``level`` (levels per block)."""
    return fields(plan_of_levels(level))


def checked_fields(*args) -> tuple:
    """``choice_plan_checked``'s answer as ``(plan, selective, partial, peak, fits)`` (``fields``)."""
    plan, peak, fits = choice_plan_checked(*args)
    return (*fields(plan), peak, fits)


def per_plan(predict):
    """A ``choice_plan_checked`` predictor (a peak per row of levels) from one over ``(plan, selective)``."""
    def predict_peaks(levels):
        return np.array([predict(tuple(np.flatnonzero(row > 0).tolist()), tuple(np.flatnonzero(row == 1).tolist()))
                         for row in levels])
    return predict_peaks


def _additive(savings_of, levels_of):
    """A peak predictor over ``(plan, selective)``: 100 minus what the blocks' levels save."""
    def predict(plan, selective):
        levels = [2 if i in plan and i not in selective else 1 if i in selective else 0 for i in range(len(levels_of))]
        return 100.0 - sum(savings_of[level][i] for i, level in enumerate(levels))
    return predict


def test_the_scheduler_takes_the_choice_that_frees_enough_for_the_least_time():
    """Selective frees 6 for 1 ms, recompute 10 for 4 ms: an excess of 5 takes one selective block,
    of 12 two selective blocks (12 for 2 ms, cheaper than a recompute and a selective, 5 ms)."""
    savings = [[0.0] * 3, [6.0] * 3, [10.0] * 3]
    costs = [[0.0] * 3, [1.0] * 3, [4.0] * 3]
    predict = per_plan(_additive(savings, [0] * 3))
    assert checked_fields(savings, costs, predict, 95.0)[:2] == ((0,), (0,))
    plan, selective, _, peak, fits = checked_fields(savings, costs, predict, 88.0)
    assert fits and peak <= 88.0 and set(selective) == set(plan) and len(plan) == 2
    # Nothing selective frees enough: every block recomputed is what fits.
    plan, selective, _, peak, fits = checked_fields(savings, costs, predict, 71.0)
    assert fits and plan == (0, 1, 2) and selective == ()


def test_a_choice_a_block_cannot_take_is_never_chosen_and_nothing_fitting_says_so():
    savings = [[0.0] * 2, [np.nan, 6.0], [10.0, 10.0]]
    costs = [[0.0] * 2, [0.1, 1.0], [4.0, 4.0]]
    predict = per_plan(_additive(np.nan_to_num(savings), [0] * 2))
    plan, selective, _, _, fits = checked_fields(savings, costs, predict, 95.0)
    assert fits and 0 not in selective
    assert checked_fields(savings, costs, predict, 50.0)[4] is False  # 20 is the most it frees


def test_a_choice_whose_time_is_not_known_is_never_chosen():
    """Block 0's selective checkpoint frees the most per ms by its bytes, but its time is NaN
    (not known): the plan frees block 1 selectively instead, and a whole recompute where that is
    not enough."""
    savings = [[0.0] * 2, [9.0, 6.0], [10.0, 10.0]]
    costs = [[0.0] * 2, [np.nan, 1.0], [4.0, 4.0]]
    predict = per_plan(_additive(savings, [0] * 2))
    plan, selective, _, _, fits = checked_fields(savings, costs, predict, 95.0)
    assert (plan, selective, fits) == ((1,), (1,), True)
    plan, selective, _, _, fits = checked_fields(savings, costs, predict, 85.0)
    assert fits and 0 not in selective and plan


def _reference_upgrades(save, cost, level, excess):
    """``choices._Upgrades.best`` written plainly over a list of options (block, level, extra
    bytes, extra ms) in block order, selective first."""
    options = []
    for i, at in enumerate(level):
        have_save, have_cost = max(save[at][i], 0.0), cost[at][i] if at else 0.0
        for to in range(1, LEVELS):
            gain = save[to][i] - have_save
            if at < to and save[to][i] >= 0 and gain > 0:
                options.append((i, to, gain, max(cost[to][i] - have_cost, 1e-9)))
    chosen, seen, total, spent = [], set(), 0.0, 0.0
    for i, to, gain, extra in sorted(options, key=lambda option: -(option[2] / option[3])):
        if i in seen:
            continue
        if chosen and total + gain >= excess:
            break
        seen.add(i)
        chosen.append((i, to))
        total, spent = total + gain, spent + extra
    covering = [option for option in options if option[2] >= excess]
    if not covering:
        return chosen
    single = min(covering, key=lambda option: option[3])
    if total < excess:
        rest = [option for option in options if option[2] >= excess - total and option[0] not in seen]
        if not rest:
            return [single[:2]]
        last = min(rest, key=lambda option: option[3])
        chosen, spent = chosen + [last[:2]], spent + last[3]
    return chosen if spent < single[3] else [single[:2]]


def _reference_choice_plan(savings, costs, predict_peak, limit_bytes):
    """The scheduler written plainly (as first written in commit 6debe05, numpy arrays throughout,
    then given the cheaper of a single covering upgrade and best-rate ones topped up, blocks
    recomputed whole tried selective at the end, and both passes made to skip a change that does
    not fit, or costs more, instead of stopping there; then given the partial levels, tried at the
    end as selective is), in plain Python lists, one plan predicted at a time: the plans
    ``choice_plan_checked`` must choose. ``savings`` and ``costs`` have a row per level."""
    save = [[-1.0 if np.isnan(v) else float(v) for v in row] for row in savings]
    cost = [[float(v) for v in row] for row in costs]
    top = LEVELS - 1
    level, taken = [0] * len(save[0]), []

    def plan_of(levels):
        return (tuple(i for i, at in enumerate(levels) if at), tuple(i for i, at in enumerate(levels) if at == 1),
                tuple((i, PARTIAL_LEVELS[at - 2]) for i, at in enumerate(levels) if 1 < at < top))

    peak = predict_peak(*plan_of(level))
    while peak > limit_bytes:
        excess, upgrades = peak - limit_bytes, []
        while excess > 0 and (found := _reference_upgrades(save, cost, level, excess)):
            upgrades += found
            for i, to in found:
                excess -= save[to][i] - max(save[level[i]][i], 0.0)
                taken.append((i, level[i]))
                level[i] = to
        if not upgrades:
            rest = [i for i, at in enumerate(level) if at < top]
            if not rest:
                return (*plan_of(level), peak, False)
            taken += [(i, level[i]) for i in rest]
            level = [top] * len(level)
        peak = predict_peak(*plan_of(level))
    def price(at, i):
        return cost[at][i] if at else 0.0

    def tried(level, peak, changes):
        for i, to in changes:
            if level[i] == to or price(to, i) > price(level[i], i):
                continue
            trial = level.copy()
            trial[i] = to
            trial_peak = predict_peak(*plan_of(trial))
            if trial_peak <= limit_bytes:
                level, peak = trial, trial_peak
        return level, peak

    level, peak = tried(level, peak, reversed(taken))
    lighter = [(i, to) for i, at in enumerate(level) if at > 1 for to in range(1, at)
               if save[to][i] >= 0 and cost[to][i] < cost[at][i]]
    lighter.sort(key=lambda change: (save[level[change[0]]][change[0]] - save[change[1]][change[0]], change[0]))
    level, peak = tried(level, peak, lighter)
    return (*plan_of(level), peak, True)


def test_the_scheduler_chooses_as_its_plain_reference():
    """On 300 made-up stacks of 1-48 blocks in a random forward order (integer ms, so that ties are
    common; in every other stack bytes that are not integers and inputs let go of, whose sums
    depend on the order of the additions), budgets from below every block recomputed to above
    none: the same plan, peak and verdict as the plain reference, which predicts one plan at a
    time. Exact equality: both run the same float64 operations in the same order (a plan's peak
    does not depend on the plans predicted with it, ``Timeline._let_go``). The scheduler predicts
    its passes' plans in batches: every plan the reference predicted, in the same order, in fewer
    calls."""
    rng = random.Random(0)
    fewer = partial_plans = 0
    for trial in range(300):
        n = rng.randint(1, 48)
        pred = random_prediction(rng, n)
        pred.order = tuple(rng.sample(range(n), n))
        if trial % 2:
            pred.blocks = {q: v * rng.uniform(0.3, 3.0) for q, v in pred.blocks.items()}
            pred.releases = np.array([[rng.random() < 0.3 for _ in range(n)] for _ in range(n)])
        # Every other stack also with the partial levels, each open to a block at random.
        kept_sets = KEPT_SETS if trial % 4 < 2 else KEPT_SETS[:1]
        savings, costs = [np.zeros(n)], [np.zeros(n)]
        recompute_ms = np.array([float(rng.randint(1, 8)) for _ in range(n)])
        for kept_set in KEPT_SETS:
            freed = pred.savings - np.maximum(pred.blocks[f"{kept_set}_extra_bytes"], 0.0)
            open_to = np.array([kept_set in kept_sets and rng.random() < 0.8 for _ in range(n)])
            savings.append(np.where((freed > 0) & open_to, freed, np.nan))
            costs.append(recompute_ms - np.array([float(rng.randint(0, 6)) for _ in range(n)]))
        savings.append(pred.savings)
        costs.append(recompute_ms)
        low, high = plan_peak_bytes(pred, recomputed(range(n), n)), plan_peak_bytes(pred, recomputed((), n))
        limit = float(rng.randint(int(min(low, high)) - 20, int(max(low, high)) + 5))
        timeline, predicted, calls = Timeline(pred), [], []

        def predict_peaks(levels):
            calls.append(len(levels))
            predicted.extend(plan_of(row.tolist()) for row in levels)
            return timeline.level_peaks(levels)

        reference_predicted = []

        def predict(plan, chosen, partial):
            reference_predicted.append((plan, chosen, partial))
            return plan_peak_bytes(pred, plan_of_fields(n, plan, chosen, (), partial))

        fast = checked_fields(savings, costs, predict_peaks, limit)
        assert fast == _reference_choice_plan(savings, costs, predict, limit), trial
        rest = iter(predicted)
        assert all(plan in rest for plan in reference_predicted), trial  # a subsequence
        assert len(calls) <= len(reference_predicted), trial
        fewer += len(calls) < len(reference_predicted)
        partial_plans += bool(fast[2])
    assert fewer > 30
    assert partial_plans > 30  # the partial levels were chosen, not only offered


def test_two_blocks_checkpointed_selectively_rather_than_one_recomputed_where_they_cost_less():
    """One recompute covers the excess alone (5 ms), but two selective checkpoints cover it too
    for 2 ms: the scheduler takes the cheaper pair, as the oracle over the same choices does (a
    base-width BERT's tight budget: one layer recomputed for ~540 ms where two selective ones
    cost ~210 ms). Where the pair costs more, the single recompute stays."""
    def peak(plan, selective):
        return 1000.0 - sum(60.0 if i in selective else 100.0 for i in plan)

    savings = [np.zeros(4), np.full(4, 60.0), np.full(4, 100.0)]
    plan, selective, _, predicted, fits = checked_fields(
        savings, [np.zeros(4), np.full(4, 1.0), np.full(4, 5.0)], per_plan(peak), 900.0)
    assert (plan, selective, predicted, fits) == ((0, 1), (0, 1), 880.0, True)
    dearer = [np.zeros(4), np.full(4, 3.0), np.full(4, 5.0)]
    plan, selective, _, _, fits = checked_fields(savings, dearer, per_plan(peak), 900.0)
    assert (plan, selective, fits) == ((0,), (), True)


def test_a_block_recomputed_whole_goes_selective_where_that_still_fits_and_costs_less():
    """The greedy takes block 0 whole (the best bytes per ms) and block 1 selective for the rest;
    block 0 selective frees enough too, for less: the plan ends with both selective (SQuAD-like
    lengths at a roomy budget, where the oracle took both selective). Where block 0 selective no
    longer fits, it stays recomputed."""
    def peak(plan, selective):
        return 1000.0 - sum(60.0 if i in selective else 100.0 for i in plan)

    savings = [np.zeros(4), np.full(4, 60.0), np.full(4, 100.0)]
    costs = [np.zeros(4), np.full(4, 9.0), np.full(4, 10.0)]
    assert checked_fields(savings, costs, per_plan(peak), 885.0) == ((0, 1), (0, 1), (), 880.0, True)
    assert checked_fields(savings, costs, per_plan(peak), 879.0) == ((0, 1), (1,), (), 840.0, True)


def test_an_upgrade_that_cannot_be_given_back_does_not_stop_the_others_being_given_back():
    """The savings read 50 bytes for each block checkpointed selectively, but block 2's frees 130
    on the timeline: the greedy takes blocks 0 and 1 selective, then block 2 for the rest. Block 2
    cannot be given back, blocks 1 and 0 can: the plan ends with block 2 alone, as an exhaustive
    search finds (a base-width BERT: Mimose kept three layers selective and one recomputed where
    the oracle's one recomputed and one selective fit); at a lower limit all three stay."""
    freed = {1: [50.0, 50.0, 130.0, 50.0], 2: [100.0, 100.0, 150.0, 100.0]}

    def peak(plan, selective):
        return 1000.0 - sum(freed[1 if i in selective else 2][i] for i in plan)

    savings = [np.zeros(4), np.full(4, 50.0), np.full(4, 100.0)]
    costs = [np.zeros(4), np.full(4, 1.0), np.full(4, 3.0)]
    assert checked_fields(savings, costs, per_plan(peak), 880.0) == ((2,), (2,), (), 870.0, True)
    assert checked_fields(savings, costs, per_plan(peak), 800.0)[:2] == ((0, 1, 2), (0, 1, 2))


def test_the_choice_times_say_selective_costs_the_light_ops_and_the_dispatch_modes():
    bl = np.array([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]])  # work = B * L (``features.FEATURES`` order)
    times = ChoiceTimes(heavy=np.array([[0.0, 0.01]]), light=np.array([[0.0, 0.002]]), heavy_work=bl, light_work=bl,
                        heavy_ops=np.array([5.0]), light_ops=np.array([20.0]), meter_ms=0.01, mode_ms=0.005)
    recompute, selective = times.at(TOKENS.of((10, 100)))
    assert recompute[0] == pytest.approx(10 + 2 + 25 * 0.01)
    assert selective[0] == pytest.approx(2 + 20 * 0.01 + 2 * 25 * 0.005)
    again = ChoiceTimes.from_state(times.state_dict(), TOKENS)
    assert np.allclose(again.at(TOKENS.of((10, 100))), (recompute, selective))
    state = times.state_dict()  # written before the work was known: times linear in B * L
    del state["heavy_work"], state["light_work"]
    assert np.allclose(ChoiceTimes.from_state(state, TOKENS).at(TOKENS.of((10, 100))), (recompute, selective))


def _measured_works(planner, size) -> dict:
    """Each block's ``(heavy, light)`` work in a measuring run at ``size``: the sums of its ops'
    ``factor * prod(dims)`` (``LiveProbe.works``), a light op's weighted by its kind's rate over a
    pointwise op's (``ChoiceTimes.light_weights``)."""
    batch = make(size)
    policy = planner.policy
    policy.measurer.lifetimes = True
    try:
        policy.measurer.begin(inputs=batch)
        with planner.parts.router.using(policy.measurer):
            probe_step(planner.parts, batch)
        raw = policy.measurer.end()
    finally:
        policy.measurer.lifetimes = False
    weights = planner.policy.choice_times.light_weights or {}

    def work(heavy, dims, factor, kind):
        return factor * math.prod(dims) * (1.0 if heavy else weights.get(kind, 1.0))

    return {i: tuple(sum(work(*op) for op in works if op[0] == heavy) for heavy in (True, False))
            for i, works in raw.op_works.items()}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_time_model_grows_with_the_work_the_ops_do_at_any_size(attention):
    """The work of each block's compute-heavy ops (floating-point operations, read off their
    operands' shapes) and of its other ops (elements written), scaled from the two probes, is
    the work its ops do at held-out sizes, to float rounding: quadratic in the length where
    attention is (a time model fitted ``a + c * B * L`` through two probes of 8 and 12 tokens
    is not), so the recompute times grow with it; timing the rates leaves training's random
    numbers as they were. Held-out batches of two rows or more: the
    probes' batches are (a batch of one runs other ops: the mask is not broadcast)."""
    with metered_mimose(tiny_bert(2, attention=attention), choices="selective") as (planner, meter):
        rng = torch.get_rng_state()
        planner.prepare(make, (4, 128))
        times = planner.policy.choice_times
        for size in ((2, 40), (3, 50), (4, 128)):
            measured = _measured_works(planner, size)
            for i, (heavy, light) in measured.items():
                assert times.heavy_work[i] @ TOKENS.of(size) == pytest.approx(heavy, rel=1e-9), (size, i)
                assert times.light_work[i] @ TOKENS.of(size) == pytest.approx(light, rel=1e-9), (size, i)
        quadratic = TOKENS.names.index("BL2")
        assert torch.equal(torch.get_rng_state(), rng)  # the rates' timing drew from a forked generator
        assert (times.heavy_work[:, quadratic] > 0).all() and (times.light_work[:, quadratic] > 0).all()
        # the rates timed on ops as large as the largest batch's: a longer batch costs more
        assert (times.heavy[:, 1] > 0).all() and (times.light[:, 1] > 0).all()
        assert (times.at(TOKENS.of((4, 128)))[0] > times.at(TOKENS.of((2, 64)))[0]).all()


def test_finer_plans_fit_hold_their_predictions_and_compute_what_plain_training_does():
    """With selective recompute made cheap in the time model, a middle budget is met by plans
    that checkpoint blocks selectively; every such plan's measured peak is within its prediction
    (never under) and within 2 % of it; the losses equal plain training's bit for bit: the
    recompute runs the same ops in the same order on the same inputs (torch's selective
    checkpointing hands back the forward's own outputs of the ops it kept)."""
    with metered_mimose(tiny_bert(4), choices="selective") as (planner, meter):
        planner.prepare(make, (4, 64))
        assert planner.policy.choice_times is not None and planner.policy._selective_known()
        planner.policy.choice_times.mode_ms = 0.0  # selective recompute as cheap as its light ops
        for p in planner.model.parameters():
            p.grad = None
        seen = 0
        for size in HELD_OUT:
            batch = make(size)
            none_peak = probe_with_plan(planner.parts, batch, recomputed((), 4))
            full_peak = probe_with_plan(planner.parts, batch, recomputed(range(4), 4))
            planner.parts.budget_bytes = int(full_peak + 0.5 * (none_peak - full_peak))
            planner.policy.cache = {}
            decision = planner.policy.decide(size)
            assert decision.predicted_peak_bytes <= planner.limit_bytes
            measured = probe_with_plan(planner.parts, batch, decision.plan)
            assert measured <= decision.predicted_peak_bytes <= measured * 1.02, (size, decision)
            seen += "selective" in decision.plan
        assert seen  # the budgets were met with selective blocks


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    return LlamaForCausalLM(config).train()


def _llama_batch(size):
    ids = torch.randint(0, 64, size, generator=torch.Generator().manual_seed(size[0] * 1000 + size[1]))
    return {"input_ids": ids, "labels": ids}


class _MatmulEnding(torch.nn.Module):
    """Blocks that end in a matmul: its output, kept by a selective checkpoint, is what the block
    returns, and non-reentrant checkpointing stops recomputing before it (its input is the last
    tensor saved), so the checkpoint's cache holds it after the next block's backward let it go."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                                              torch.nn.Linear(64, 32)) for _ in range(3))
        self.head = torch.nn.Linear(32, 2)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).float().pow(2).mean()


def _ids_batch(size):
    return {"input_ids": _llama_batch(size)["input_ids"]}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stack", ["pre-norm", "post-norm", "matmul-ending"])
def test_every_choice_of_every_block_is_predicted_never_under(stack, precision):
    """Every plan of keep / selective / recompute per layer, at sizes the probes did not run:
    measured <= predicted <= measured + 2 % (3 % in bf16). A selective checkpoint keeps its heavy
    outputs until its recompute takes each back, and what that holds beyond a full checkpoint
    changes over the step: its forward holds the kept outputs the checkpointed run had freed by
    each op (``selective_fwd_peak_bytes``); its recompute those it has not come to yet
    (``selective_recompute_peak_bytes``: a post-norm BERT layer's recompute peaks with them).
    Non-reentrant checkpointing stops recomputing once the last saved tensor is packed again,
    before a pre-norm layer's last matmul (Llama's ``down_proj``) or a block's final matmul runs:
    an output kept for it would stay cached through the block's backward, so it is not kept
    (``PlanRunner.selective_keep``), which lowers the step's peak."""
    import itertools

    from mimose_cli.planners.trial import loss_of

    dtype = {"fp32": None, "bf16": torch.bfloat16}[precision]
    model, make_batch, largest, sizes = {
        "pre-norm": lambda: (_tiny_llama(), _llama_batch, (4, 64), ((2, 40), (4, 64), (3, 100))),
        "post-norm": lambda: (tiny_bert(3, attention="sdpa", max_length=256), make, (8, 128),
                              ((4, 40), (2, 100), (8, 128))),
        "matmul-ending": lambda: (_MatmulEnding(), _ids_batch, (4, 64), ((2, 40), (4, 64), (3, 100))),
    }[stack]()

    def step_fn(batch):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_of(planner.model(**batch))
        loss.backward()

    # Under autocast the probes' checkpointed run casts the weights afresh while the measuring
    # run's casts are still cached: an upper bound, up to 2.5 % of these 1 MB steps.
    over = 1.02 if dtype is None else 1.03
    with metered_mimose(model, choices="selective") as (planner, meter):
        planner.prepare(make_batch, largest, step_fn=step_fn)
        assert planner.policy._selective_known()
        if stack == "post-norm":  # its recompute peaks holding the kept outputs it has not come to
            blocks = planner.policy.estimator.predict(largest).blocks
            assert (blocks["selective_recompute_peak_bytes"] > blocks["recompute_peak_bytes"]).all()
        else:  # the last matmul's output is not kept: its recompute would never take it back
            every, batch = (0, 1, 2), make_batch(largest)
            keep, planner.parts.plan_runner.selective_keep = planner.parts.plan_runner.selective_keep, {}
            all_kept = probe_with_plan(planner.parts, batch, ("selective",) * 3, step_fn=step_fn)
            planner.parts.plan_runner.selective_keep = keep
            assert probe_with_plan(planner.parts, batch, ("selective",) * 3, step_fn=step_fn) < all_kept
        for size in sizes:
            batch = make_batch(size)
            for levels in itertools.product((0, 1, 2), repeat=3):
                plan = tuple(("keep", "selective", "recompute")[level] for level in levels)
                predicted = planner.predict_peak(size, plan)
                measured = probe_with_plan(planner.parts, batch, plan, step_fn=step_fn)
                assert measured <= predicted <= measured * over, (size, levels, predicted, measured)


def test_a_selective_blocks_forward_peak_is_predicted_as_measured():
    """A selective block's forward runs the checkpointed run's ops holding, at each, the heavy
    outputs it kept that the checkpointed run had freed by then: its predicted forward peak is the
    one measured around the block in a planned step (to float rounding), below the checkpointed
    peak plus everything it keeps (the bound used before)."""
    with metered_mimose(tiny_bert(4), choices="selective") as (planner, meter):
        planner.prepare(make, (4, 64))
        block = planner.blocks[1][1]
        for size in HELD_OUT:
            peaks = []

            def enter(module, args):
                if not peaks:
                    peaks.append(meter.current_bytes())
                    meter.reset_peak()

            def leave(module, args, out):
                if len(peaks) == 1:
                    peaks.append(meter.peak_bytes() - peaks[0])
            hooks = block.register_forward_pre_hook(enter), block.register_forward_hook(leave)
            try:
                probe_with_plan(planner.parts, make(size), ("recompute", "selective", "recompute", "recompute"))
            finally:
                for hook in hooks:
                    hook.remove()
            blocks = planner.policy.estimator.predict(size).blocks
            assert blocks["selective_fwd_peak_bytes"][1] == pytest.approx(peaks[1], rel=1e-9), size
            assert peaks[1] < blocks["ckpt_fwd_peak_bytes"][1] + blocks["selective_extra_bytes"][1]


def test_a_step_planned_with_selective_blocks_says_so_and_trains_as_plain():
    model, reference = tiny_bert(4), tiny_bert(4)
    data = bert_batch(4, 64)
    from mimose_cli.memory import build_meter
    from mimose_cli.planners.baselines.uniform import NoCheckpointing
    from mimose_cli.planners.mimose.policy import Mimose

    meter = build_meter("simulated", 10**9)
    with meter.activate():
        meter.track(model, reference)
        plain = NoCheckpointing(reference, meter=meter)
        plain_loss, none_peak, _ = run_step(plain, meter, data)
        plain.close()
        planner = Mimose(model, 10**9, meter=meter, choices="selective")
        planner.prepare(lambda size: bert_batch(*size), (4, 64))
        planner.policy.choice_times.mode_ms = 0.0
        meter.track(data)
        # Room for the step with one block checkpointed selectively: cheaper than recomputing one.
        planner.parts.budget_bytes = planner.predict_peak((4, 64), ("selective", "keep", "keep", "keep")) + 1024
        budget = planner.budget_bytes
        loss, peak, info = run_step(planner, meter, data)
        planner.close()
    assert "selective" in info.plan
    assert peak <= budget < none_peak and torch.equal(loss, plain_loss)


def test_the_heat_map_shows_selective_and_partial_blocks_and_records_keep_them():
    records = [StepRecord(step=0, plan=["recompute", "selective", "keep", "partial2"], num_blocks=4,
                          loss=1.0, peak_bytes=1000),
               StepRecord(step=1, plan=[], num_blocks=4)]
    figure = plan_figure(records)
    image = figure.axes[0].images[0].get_array()
    assert image[0, 0] == 4.0 and image[1, 0] == 2.0 and image[2, 0] == 0.0 and image[3, 0] == 3.0
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert "checkpointed selectively" in labels and "checkpointed partially" in labels
    again = StepRecord.from_json(records[0].to_json())
    assert again.plan == records[0].plan and again.blocks("selective") == again.blocks("partial") == 1


def test_a_recipe_chooses_the_choice_set_and_refuses_others():
    recipe = load_recipe(QUICKSTART, ["planner.mimose.choices=selective"])
    assert recipe.planner.keywords["choices"] == "selective"
    with pytest.raises(ValueError, match="choices"):
        load_recipe(QUICKSTART, ["planner.mimose.choices=everything"])


def test_selective_plans_that_cannot_be_priced_say_so_and_stay_block_level(monkeypatch):
    """When the probes' ops did not run alike at their two sizes (``ChoiceTimes.from_probes`` is
    None), a warning says plans stay block-level and ``stats`` says selective is not in use."""
    with metered_mimose(tiny_bert(2), choices="selective") as (planner, meter):
        planner.prepare(make, (4, 64))
        assert planner.stats["selective_in_use"] is True
    monkeypatch.setattr(ChoiceTimes, "from_probes", staticmethod(lambda *args, **kwargs: None))
    with metered_mimose(tiny_bert(2), choices="selective") as (planner, meter):
        with pytest.warns(UserWarning, match="plans stay block-level"):
            planner.prepare(make, (4, 64))
        assert planner.stats["selective_in_use"] is False
        planner.parts.budget_bytes = 1
        assert planner.policy.decide((4, 40)).plan.count("selective") == 0


def test_block_level_plans_checkpoint_nothing_selectively():
    with metered_mimose(tiny_bert(4)) as (planner, meter):
        planner.prepare(make, (4, 64))
        assert planner.policy.choice_times is None and not planner.policy._selective_known()
        assert planner.stats["selective_in_use"] is False
        planner.parts.budget_bytes = 1  # nothing fits: every block, none selectively
        assert planner.policy.decide((4, 40)).plan.count("selective") == 0


def test_the_oracle_searches_the_same_choices_and_its_plans_fit():
    """``oracle`` with ``choices="selective"``: every plan of keep / selective / recompute over 4
    blocks, on this size's measurements; with selective made cheap in the time model a middle
    budget takes selective blocks, the step fits, and its recompute time is no more than the
    block-level oracle's plan costs under the same times."""
    from mimose_cli.memory import build_meter
    from mimose_cli.planners.baselines.oracle import Oracle, optimal_plan, plan_peak

    model = tiny_bert(4)
    data = bert_batch(4, 64)
    meter = build_meter("simulated", 10**9)
    with meter.activate():
        meter.track(model, data)
        oracle = Oracle(model, 10**9, meter=meter, choices="selective")
        oracle.policy._dispatch_costs = (0.0, 0.0)  # selective recompute costs its light ops only
        pred = oracle.policy.measure((4, 64), data)
        oracle.policy.measured[(4, 64)] = pred
        base = meter.current_bytes()
        none_peak, full_peak = plan_peak(pred, ()), plan_peak(pred, tuple(range(4)))
        oracle.parts.budget_bytes = int(base + full_peak + 0.5 * (none_peak - full_peak))
        decision = oracle.policy.decide((4, 64))
        recompute_ms, selective_ms = oracle.policy.choice_ms[(4, 64)]
        partial_ms, plan = oracle.policy.partial_ms[(4, 64)], decision.plan
        block_level = optimal_plan(pred, oracle.limit_bytes - base)
        cost = sum(selective_ms[i] if plan[i] == "selective" else
                   partial_ms[i, PARTIAL_LEVELS.index(plan[i])] if plan[i] in PARTIAL_LEVELS else recompute_ms[i]
                   for i in fields(plan)[0])
        assert set(plan) & {"selective", *PARTIAL_LEVELS} and cost <= sum(recompute_ms[i] for i in block_level) + 1e-9
        loss, peak, info = run_step(oracle, meter, data)
        oracle.close()
    assert info.plan == decision.plan and peak <= oracle.budget_bytes


def test_blocks_whose_savings_read_zero_are_still_taken_when_the_plan_needs_them():
    """The savings only approximate the peak: where no upgrade frees more by them and the plan
    still does not fit, the rest are recomputed, as the block-level greedy adds blocks."""
    savings = [[0.0] * 3, [np.nan] * 3, [0.0, 0.0, 5.0]]
    costs = [[0.0] * 3, [1.0] * 3, [4.0] * 3]
    predict = per_plan(lambda p, s: 100.0 - 10 * len(p))
    plan, selective, _, peak, fits = checked_fields(savings, costs, predict, 75.0)
    assert fits and peak <= 75.0 and len(plan) >= 3 and selective == ()


def test_an_estimator_saved_before_finer_plans_still_loads_and_plans_block_level():
    with metered_mimose(tiny_bert(4)) as (planner, meter):
        planner.prepare(make, (4, 64))
        state = planner.policy.estimator.state_dict()
    state["block_quantities"] = [q for q in state["block_quantities"] if not q.startswith("selective_")]
    state["layout"] = [row for row in state["layout"] if not row[0].startswith("selective_")]
    with metered_mimose(tiny_bert(4), choices="selective") as (planner, meter):
        planner.policy.estimator.load_state_dict(state)
        assert planner.policy.estimator.fitted and not planner.policy._selective_known()


def test_a_resumed_planner_keeps_the_same_heavy_outputs_and_an_older_state_plans_block_level():
    """What a selective checkpoint keeps per block (``PlanRunner.selective_keep``, counted by the
    probes) travels in the planner's state: a resumed run keeps the outputs the estimate assumed;
    a state written before it was counted plans block-level, not with bytes it would not hold."""
    with metered_mimose(_tiny_llama(), choices="selective") as (planner, meter):
        planner.prepare(_llama_batch, (4, 64))
        keep, state = dict(planner.parts.plan_runner.selective_keep), planner.state_dict()
    assert sorted(keep) == [0, 1, 2] and len(set(keep.values())) == 1
    with metered_mimose(_tiny_llama(), choices="selective") as (planner, meter):
        planner.load_state_dict(state)
        assert planner.parts.plan_runner.selective_keep == keep and planner.policy._selective_known()
    del state["selective_keep"]
    with metered_mimose(_tiny_llama(), choices="selective") as (planner, meter):
        planner.load_state_dict(state)
        assert not planner.policy._selective_known()
        assert planner.policy.decide((4, 64)).plan.count("selective") == 0


def _work_of(fn, *args):
    """``heavy_op_work`` of the compute-heavy ops ``fn(*args)`` runs: their flops, and the gemm
    of the one op (None when several ran or it is an attention kernel)."""
    from mimose_cli.memory.probe import LiveProbe
    from mimose_cli.planners.ops import COMPUTE_HEAVY_OPS, heavy_op_work

    with LiveProbe(heavy_ops=COMPUTE_HEAVY_OPS, heavy_work=heavy_op_work) as probe:
        fn(*args)
    works = [w for w in probe.works if w[0]]
    return sum(factor * math.prod(dims) for _, dims, factor, _ in works), works[0][3] if len(works) == 1 else None


def test_light_ops_are_counted_by_kind_at_each_kinds_rate():
    """A light op's work is the elements it writes, told apart by kind (``blocks.light_op_class``):
    a dropout's random draw, whatever the ops it runs as on this device, an activation, a softmax,
    arithmetic. The rates are timed per kind as the ops run (``choices.work_rates_ms``), and a
    block's light work counts each kind's elements at its rate over the pointwise one, so two ops
    writing as many elements are priced apart (``scaling.work_coefficients``)."""
    from mimose_cli.memory.probe import LiveProbe
    from mimose_cli.planners.mimose.choices import work_rates_ms
    from mimose_cli.planners.mimose.scaling import work_coefficients
    from mimose_cli.planners.ops import COMPUTE_HEAVY_OPS, heavy_op_work, light_op_class

    x = torch.randn(6, 8)
    with LiveProbe(heavy_ops=COMPUTE_HEAVY_OPS, heavy_work=heavy_op_work, light_class=light_op_class) as probe:
        torch.nn.functional.dropout(x, 0.5, True)
        torch.nn.functional.gelu(x)
        torch.softmax(x, -1)
        x + x
    kinds = {kind for heavy, _, _, kind in probe.works if not heavy}
    assert kinds == {"random", "transcendental", "softmax", "pointwise"}
    heavy, light = work_rates_ms(64, 32, 64, "cpu")
    assert heavy > 0 and set(light) == kinds and all(rate > 0 for rate in light.values())

    def works(length):  # one random draw and one add over ``length`` elements
        return [(False, (length,), 1, "random"), (False, (length,), 1, "pointwise")]

    sizes = [(1, 8), (1, 16)]
    plain = work_coefficients(works(8), works(16), *sizes, TOKENS)[1]
    weighted = work_coefficients(works(8), works(16), *sizes, TOKENS, {"random": 5.0, "pointwise": 1.0})[1]
    at = TOKENS.of((1, 40))
    assert plain @ at == pytest.approx(80.0) and weighted @ at == pytest.approx(40.0 * 5 + 40.0)


@pytest.mark.parametrize("case", ["mm", "addmm", "bmm", "baddbmm", "conv", "grouped conv", "transposed conv",
                                  "attention", "attention, other value dim", "attention, causal"])
def test_a_heavy_ops_work_is_its_floating_point_operations(case):
    """``heavy_op_work`` counts what torch's own flop counter counts for every kind of heavy op
    (an attention: 2·B·H·Lq·Lk·(E + Ev), fused or, on the CPU with another value dim, as two
    bmm; a causal one half that, the scores its kernel skips), and the matmul it amounts to does
    the same work."""
    from torch.nn.functional import conv2d, conv_transpose2d, scaled_dot_product_attention
    from torch.utils.flop_counter import FlopCounterMode

    r = torch.randn
    fn, args = {
        "mm": (torch.mm, (r(6, 5), r(5, 7))),
        "addmm": (torch.addmm, (r(7), r(6, 5), r(5, 7))),
        "bmm": (torch.bmm, (r(3, 6, 5), r(3, 5, 7))),
        "baddbmm": (torch.baddbmm, (r(3, 6, 7), r(3, 6, 5), r(3, 5, 7))),
        "conv": (lambda x, w: conv2d(x, w, stride=2, padding=1), (r(2, 4, 9, 9), r(6, 4, 3, 3))),
        "grouped conv": (lambda x, w: conv2d(x, w, groups=2), (r(2, 4, 9, 9), r(6, 2, 3, 3))),
        "transposed conv": (lambda x, w: conv_transpose2d(x, w, stride=2), (r(2, 4, 5, 5), r(4, 3, 4, 4))),
        "attention": (scaled_dot_product_attention, (r(2, 3, 6, 8), r(2, 3, 5, 8), r(2, 3, 5, 8))),
        "attention, other value dim": (scaled_dot_product_attention, (r(2, 3, 6, 8), r(2, 3, 5, 8), r(2, 3, 5, 4))),
        "attention, causal": (lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True),
                              (r(2, 3, 6, 8), r(2, 3, 6, 8), r(2, 3, 6, 8))),
    }[case]
    flops, gemm = _work_of(fn, *args)
    if case.startswith("attention"):  # torch's counter has no formula for the CPU's fused kernel
        query, key, value = args
        # a causal kernel skips the keys past each query: half the scores and weighted values
        half = 2 if case.endswith("causal") else 1
        assert flops * half == 2 * math.prod(query.shape[:-1]) * key.shape[-2] * (query.shape[-1] + value.shape[-1])
        return
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    assert flops == counter.get_total_flops()
    rows, inner, cols, dtype = gemm
    assert 2 * rows * inner * cols == flops and dtype == torch.float32


def test_rates_that_cannot_be_timed_leave_the_probes_own_timings_and_say_so(monkeypatch):
    import mimose_cli.planners.mimose.probes as probes_module

    def fails(*args, **kwargs):
        raise torch.OutOfMemoryError("no room for the rates")

    monkeypatch.setattr(probes_module, "probe_rates_ms", fails)
    with metered_mimose(tiny_bert(2), choices="selective") as (planner, meter):
        with pytest.warns(UserWarning, match="rates could not be timed .OutOfMemoryError: no room"):
            planner.prepare(make, (4, 64))
        assert planner.policy.choice_times is not None and planner.policy._selective_known()
