"""The probes leave out the middle layers of a long stack (``blocks.stack_runs``, ``scaling.Deepening``):
the estimate is still the one every layer's probe would give."""

import numpy as np
import pytest
import torch
from test_scaling import HELD_OUT, _bf16_step, assert_estimate_is_measured, metered_mimose, padded

from mimose_cli.planners.blocks import left_out, stack_runs, twin_blocks
from mimose_cli.planners.features import Releases

from helpers import bert_batch, tiny_bert


def make(size):
    return padded(bert_batch(*size))


def _probe_stats(planner, step_fn=None) -> dict:
    planner.prepare(make, (4, 64), step_fn=step_fn)
    stats = planner.stats
    assert stats["estimate_source"] == "probes", stats["estimate_fallback"]
    return stats


def test_a_long_stacks_middle_layers_are_left_out_and_the_estimate_is_the_measured_one():
    """Eight layers: the probes run the first three and the last (the third stands for layers 3 to
    6) and their estimate equals, to float rounding, what a step with every layer measures, at
    sizes and paddings they never ran."""
    with metered_mimose(tiny_bert(8)) as (planner, meter):
        stats = _probe_stats(planner)
        assert stats["probe_skipped"] == 4 and stats["probe_steps"] == 2 and not stats["probe_skips_refused"]
        assert len(planner.model.bert.encoder.layer) == 8  # put back
        assert_estimate_is_measured(planner, make, HELD_OUT)


def test_under_bf16_the_left_out_layers_cast_weights_are_counted_until_the_forward_ends():
    """Under autocast each layer's forward leaves cast weights in autocast's cache until the
    forward ends: the left-out layers' copies of them are in the blocks' entries and gone in
    their backward, as in a step with every layer."""
    with metered_mimose(tiny_bert(7)) as (planner, meter):
        step_fn = _bf16_step(planner.model)
        stats = _probe_stats(planner, step_fn)
        # The plain probe step left them out too: layers 1 to 5 let go of their input, as with every layer.
        assert stats["probe_skipped"] == 3 and stats["probe_releases"] == 5
        assert_estimate_is_measured(planner, make, HELD_OUT[:2], step_fn)


def test_a_layer_the_model_keeps_to_the_end_runs_every_layer():
    """With ``output_hidden_states`` the model holds every layer's output until the step ends, past
    the backward of the layers next to it: what the left-out layers would hold cannot be placed,
    so every layer runs in the probes, saying why, and the estimate is still the measured one."""
    with metered_mimose(tiny_bert(6)) as (planner, meter):
        model = planner.model

        def step_fn(batch):
            out = model(**batch, output_hidden_states=True)  # held until backward has run
            out.loss.backward()

        stats = _probe_stats(planner, step_fn)
        assert stats["probe_skipped"] == 0 and "further off" in stats["probe_skips_refused"]
        assert stats["probe_steps"] == 4  # two with layers left out, two with every layer
        assert_estimate_is_measured(planner, make, HELD_OUT[:2], step_fn)


class _ByIndex(torch.nn.Module):
    """A model that runs its layers by number, ``layers[i]`` for every ``i`` it was built with."""

    def __init__(self, depth: int = 6):
        super().__init__()
        self.depth = depth
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
                                           for _ in range(depth)])

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for i in range(self.depth):
            x = self.layers[i](x)
        return x.sum()


def test_a_model_that_runs_its_layers_by_number_runs_every_layer():
    model = _ByIndex()
    with metered_mimose(model) as (planner, meter):
        ids = lambda size: {"input_ids": torch.randint(0, 16, size)}  # noqa: E731
        planner.prepare(ids, (4, 64))
        stats = planner.stats
        assert stats["estimate_source"] == "probes" and stats["probe_skipped"] == 0
        assert "IndexError" in stats["probe_skips_refused"]
        assert len(model.layers) == 6 and all(isinstance(m, torch.nn.Sequential) for m in model.layers)
        assert_estimate_is_measured(planner, ids, HELD_OUT[:2])


def test_layers_set_up_otherwise_are_not_left_out():
    """Alike in parameters but not in settings (a sliding window, an attention type): the layer
    cannot stand for the others; a layer's number (``layer_idx``) does not count."""
    model = tiny_bert(6)
    blocks = [(f"bert.encoder.layer.{i}", m) for i, m in enumerate(model.bert.encoder.layer)]
    for i, (_, layer) in enumerate(blocks):
        layer.layer_idx = i
    twins = twin_blocks(blocks)
    assert stack_runs(blocks, twins) == ([(2, (3, 4))], "")
    blocks[4][1].attention.self.sliding_window = 16
    runs, why = stack_runs(blocks, twins)
    assert runs == [] and "block 4 is set up otherwise than block 2" in why


def test_left_out_layers_are_put_back_whatever_happens():
    model = tiny_bert(6)
    blocks = [(f"bert.encoder.layer.{i}", m) for i, m in enumerate(model.bert.encoder.layer)]
    layers = list(model.bert.encoder.layer)
    try:
        with left_out(model, blocks, [3, 4]):
            assert list(model.bert.encoder.layer) == [layers[i] for i in (0, 1, 2, 5)]
            assert model.bert.encoder.layer[3] is layers[5]
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert list(model.bert.encoder.layer) == layers


def test_releases_of_a_left_out_layer_are_its_templates():
    """A left-out layer lets go of its own input as its template does, and takes a bias the whole
    stack shares; a template letting go of what blocks before it took cannot be written out."""
    releases = Releases.none(8)
    releases.consumers[2, 2] = True  # the template lets go of its own input
    releases.consumers[7, [1, 2, 7]] = True  # a bias the stack takes, let go of after the last layer
    releases.slots = {2: {0}, 7: {3}}
    deep = releases.deepened([(2, (3, 4, 5, 6))])
    assert [set(np.flatnonzero(row)) for row in deep.consumers] == [set(), set(), {2}, {3}, {4}, {5}, {6},
                                                                      {1, 2, 3, 4, 5, 6, 7}]
    assert deep.slots == {2: {0}, 3: {0}, 4: {0}, 5: {0}, 6: {0}, 7: {3}}
    releases.consumers[2, 1] = True
    with pytest.raises(ValueError, match="blocks before it"):
        releases.deepened([(2, (3, 4, 5, 6))])
