"""hf-every-n: transformers' every_n_layers stride, the largest whose largest batch fits."""

import dataclasses
import inspect

import pytest

from mimose_cli.memory import build_meter
from mimose_cli.planners.base import build_planner
from mimose_cli.planners.baselines.every_n import EveryN, stride_plan
from mimose_cli.planners.blocks import recomputed
from mimose_cli.planners.registry import PLANNERS
from mimose_cli.planners.trial import probe_with_plan

from helpers import bert_batch, tiny_bert


def test_the_stride_checkpoints_the_layers_transformers_does():
    model = tiny_bert(layers=5)
    for n in (1, 2, 3, 5, 7):
        model.activation_checkpointing_enable(every_n_layers=n)
        flagged = tuple(i for i, layer in enumerate(model.bert.encoder.layer) if layer.gradient_checkpointing)
        assert stride_plan(5, n) == flagged, n
    model.activation_checkpointing_disable()


def _prepared(budget, **options):
    model = tiny_bert(layers=4)
    meter = build_meter("simulated", None)
    with meter.activate():
        meter.track(model)
        planner = EveryN(model, budget, meter=meter, **options)
        planner.prepare(lambda size: bert_batch(*size), (8, 96))
        peaks = {n: probe_with_plan(planner.parts, bert_batch(8, 96), recomputed(stride_plan(4, n), 4))
                 for n in (1, 2, 3, 4)}
    planner.close()
    return planner, peaks


def test_prepare_picks_the_largest_stride_whose_largest_batch_fits():
    _, peaks = _prepared(None)
    assert peaks[1] < peaks[2] < peaks[4]  # more blocks kept, more memory
    budget = peaks[2]  # stride 2 fits exactly; the sparsest stride, 4, does not
    planner, _ = _prepared(budget)
    assert planner.policy.every_n_layers == max(n for n, p in peaks.items() if p <= budget) >= 2
    stride = planner.policy.every_n_layers
    assert planner.policy.decide((2, 10)).plan == recomputed(stride_plan(4, stride), 4)  # every batch alike
    assert planner.stats["stride_peaks"]["4"] == peaks[4]


def test_no_stride_fits_checkpoints_every_block_and_says_so():
    _, peaks = _prepared(None)
    with pytest.warns(UserWarning, match="no stride fits"):
        planner, _ = _prepared(peaks[1] // 2)
    assert planner.policy.every_n_layers == 1 and planner.policy.static_plan == (0, 1, 2, 3)


def test_a_given_stride_is_applied_without_measuring():
    planner = EveryN(tiny_bert(layers=4), "1GB", every_n_layers=3)
    assert planner.policy.decide((2, 10)).plan == ("recompute", "keep", "keep", "recompute")
    assert planner.policy.stride_peaks == {}
    with pytest.raises(ValueError, match="every_n_layers=0"):
        EveryN(tiny_bert(layers=4), "1GB", every_n_layers=0)


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_reads_the_options_it_was_registered_with(name):
    """One table says which options a planner takes (``PLANNERS``); the planner built by name gets
    them, defaults included, through its parts, and its policy keeps no option list of its own."""
    with build_planner(name, tiny_bert(layers=2), "1GB") as planner:
        assert planner.parts.options == PLANNERS.options(name)()
    library = set(inspect.signature(PLANNERS[name].__init__).parameters) - {"self", "parts"}
    assert not library & {f.name for f in dataclasses.fields(PLANNERS.options(name))}, name


def test_a_recipe_section_reaches_the_planner():
    from mimose_cli.launcher.recipe import load_recipe

    from helpers import QUICKSTART

    recipe = load_recipe(QUICKSTART, ["planner.name=hf-every-n", "planner.hf_every_n.every_n_layers=2"])
    assert recipe.planner.keywords == {"every_n_layers": 2}
    planner = build_planner("hf-every-n", tiny_bert(layers=4), "1GB", **recipe.planner.keywords)
    assert planner.policy.decide((2, 10)).plan == ("recompute", "keep", "recompute", "keep")
