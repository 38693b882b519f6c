"""The probes leave out the middle layers of a long stack (``blocks.stack_runs``, ``scaling.Deepening``):
the estimate is still the one every layer's probe would give."""

import numpy as np
import pytest
import torch
from test_scaling import HELD_OUT, _bf16_step, assert_estimate_is_measured, metered_mimose, padded, probed_stats

from mimose_cli.planners.blocks import recomputed
from mimose_cli.planners.mimose.features import Releases
from mimose_cli.planners.mimose.layout import left_out, stack_runs, twin_blocks
from mimose_cli.planners.mimose.probes import Probes
from mimose_cli.planners.trial import probe_with_plan
from mimose_cli.torch_private import without_dispatch_modes

from helpers import bert_batch, tiny_bert


def make(size):
    return padded(bert_batch(*size))


def _probe_stats(planner, step_fn=None) -> dict:
    planner.prepare(make, (4, 64), step_fn=step_fn)
    stats = planner.stats
    assert stats["estimate_source"] == "probes", stats["estimate_fallback"]
    return stats


def test_a_long_stacks_middle_layers_are_left_out_and_the_estimate_is_the_measured_one():
    """Eight layers: the probes run the first two and the last (the second stands for layers 2 to
    6) and their estimate equals, to float rounding, what a step with every layer measures, at
    sizes and paddings they never ran."""
    with metered_mimose(tiny_bert(8)) as (planner, meter):
        stats = _probe_stats(planner)
        # Two probe steps and the check at the smaller size with one layer more.
        assert stats["probe_skipped"] == 5 and stats["probe_steps"] == 3 and not stats["probe_skips_refused"]
        assert stats["probe_twins"] == 2 and not stats["probe_first_refused"]  # layers 1 and 7 run as layer 0
        assert len(planner.model.bert.encoder.layer) == 8  # put back
        assert_estimate_is_measured(planner, make, HELD_OUT)
        for p in planner.model.parameters():
            p.grad = None  # as at a step's start
        for size in HELD_OUT:  # and the step peaks they give, never under
            batch = make(size)  # live while the step is planned, as in training
            for plan in (recomputed(blocks, 8) for blocks in ((), (0, 4, 7), range(8))):
                predicted = planner.predict_peak(size, plan)
                measured = probe_with_plan(planner.parts, batch, plan)
                assert measured <= predicted <= measured * 1.02, (size, plan)


def test_under_bf16_the_left_out_layers_cast_weights_are_counted_until_the_forward_ends():
    """Under autocast each layer's forward leaves cast weights in autocast's cache until the
    forward ends: the left-out layers' copies of them are in the blocks' entries and gone in
    their backward, as in a step with every layer."""
    with metered_mimose(tiny_bert(8)) as (planner, meter):
        step_fn = _bf16_step(planner.model)
        stats = _probe_stats(planner, step_fn)
        # The plain probe step left them out too: layers 1 to 6 let go of their input, as with every layer.
        assert stats["probe_skipped"] == 5 and stats["probe_releases"] == 6
        assert_estimate_is_measured(planner, make, HELD_OUT[:2], step_fn)


def test_a_layer_the_model_keeps_to_the_end_runs_every_layer():
    """With ``output_hidden_states`` the model holds every layer's output until the step ends, past
    the backward of the layers next to it: what the left-out layers would hold cannot be placed,
    so every layer runs in the probes, saying why, and the estimate is still the measured one."""
    with metered_mimose(tiny_bert(8)) as (planner, meter):
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

    def __init__(self, depth: int = 8):
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
        assert len(model.layers) == 8 and all(isinstance(m, torch.nn.Sequential) for m in model.layers)
        assert_estimate_is_measured(planner, ids, HELD_OUT[:2])


def test_layers_set_up_otherwise_are_not_left_out():
    """Alike in parameters but not in settings (a sliding window, an attention type): the layer
    cannot stand for the others; a layer's number (``layer_idx``) does not count."""
    model = tiny_bert(8)
    blocks = [(f"bert.encoder.layer.{i}", m) for i, m in enumerate(model.bert.encoder.layer)]
    for i, (_, layer) in enumerate(blocks):
        layer.layer_idx = i
    twins = twin_blocks(blocks)
    assert stack_runs(blocks, twins) == ([(1, (2, 3, 4, 5, 6))], "")
    blocks[4][1].attention.self.sliding_window = 16
    runs, why = stack_runs(blocks, twins)
    assert runs == [] and "block 4 is set up otherwise than block 1" in why


def test_a_stack_too_short_to_pay_for_the_check_runs_every_layer():
    """Five layers would leave two out: two probe steps with two layers fewer do not pay for the
    one that checks them; six would leave three out, which does."""
    model = tiny_bert(6)
    blocks = [(f"bert.encoder.layer.{i}", m) for i, m in enumerate(model.bert.encoder.layer)]
    runs, why = stack_runs(blocks[:5], twin_blocks(blocks[:5]))
    assert runs == [] and "leaving 2 of 5 layers out would not pay" in why
    assert stack_runs(blocks, twin_blocks(blocks)) == ([(1, (2, 3, 4))], "")


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


def test_the_plain_probe_step_with_layers_left_out_sees_what_every_layer_lets_go_of():
    """Under bf16 each layer lets go of its input: written out for every layer, the plain probe
    step that left layers out says what one running every layer says."""
    with metered_mimose(tiny_bert(8)) as (planner, meter):
        step_fn = _bf16_step(planner.model)
        runs, _ = stack_runs(planner.blocks, twin_blocks(planner.blocks))
        probes = Probes(planner.parts, planner.policy.measurer, planner.policy.estimator.feature_set, "block", make,
                        step_fn)
        with without_dispatch_modes():
            deep, _ = probes._plain_probe((2, 8), runs)
            full, _ = probes._plain_probe((2, 8), [])
        assert runs == [(1, (2, 3, 4, 5, 6))] and full.count == 6
        assert np.array_equal(deep.consumers, full.consumers) and deep.slots == full.slots


class _Layer(torch.nn.Module):
    def __init__(self, layer_idx: int = 0):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.layer_idx = layer_idx

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x)) + x


class _Deep(torch.nn.Module):
    """Eight layers alike; ``pooled``: the head takes a statistic over every layer's output
    (memory that grows with the layers, outside them)."""

    def __init__(self, layer=_Layer, pooled: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 16)
        self.layers = torch.nn.ModuleList([layer(i) for i in range(8)])
        self.pooled = pooled

    def forward(self, input_ids):
        x = self.embed(input_ids)
        outputs = []
        for layer in self.layers:
            x = layer(x)
            outputs.append(x)
        if self.pooled:
            with torch.no_grad():
                spread = torch.stack(outputs).std(0)
            x = x * spread
        return x.float().pow(2).sum()


def ids(size):
    return {"input_ids": torch.randint(0, 16, size, generator=torch.Generator().manual_seed(size[1]))}


def _deep_stats(model, step_fn=None) -> dict:
    return probed_stats(model, ids, HELD_OUT[:2], step_fn)


def test_memory_that_grows_with_the_layers_outside_them_runs_every_layer():
    """The head stacks every layer's output: with layers left out it holds fewer, which the
    check with one layer more sees; every layer runs, and the estimate is the measured one (the
    head's peak was 44 % low)."""
    stats = _deep_stats(_Deep(pooled=True))
    assert stats["probe_skipped"] == 0 and "changes when one more of them runs" in stats["probe_skips_refused"]
    assert _deep_stats(_Deep())["probe_skipped"] == 5  # the same model without the pooled head


def test_a_first_layer_whose_input_needs_no_gradient_does_not_stand_for_the_others():
    """Frozen embeddings: the first layer's input needs no gradient, the second's does, so the
    first runs otherwise (its backward computes no input gradient). The plain probe step sees it:
    the second layer stands for the later ones, the first is measured on its own, and the
    estimate is still the measured one."""
    model = _Deep()
    model.embed.requires_grad_(False)
    stats = _deep_stats(model)
    assert "block 0's inputs need gradients otherwise than block 1's" in stats["probe_first_refused"]
    assert stats["probe_skipped"] == 4 and stats["probe_twins"] == 2  # layers 2 and 7 run as layer 1


def test_a_left_out_layer_with_a_hook_runs_every_layer():
    """A hook on a middle layer (an activation monitor keeping what it sees) would not run with the
    layer left out: such a layer stays in."""
    model = _Deep()
    kept = []
    model.layers[4].register_forward_hook(lambda module, args, out: kept.append(out.detach().repeat(1, 1, 8)))
    stats = _deep_stats(model)
    assert stats["probe_skipped"] == 0 and "block 4 has other hooks than block 1" in stats["probe_skips_refused"]


class _Windowed(_Layer):
    """From its number on, a layer runs heavier (a window chosen by ``layer_idx``, as older Qwen2)."""

    def forward(self, x):
        h = self.linear(x)
        if self.layer_idx >= 4:
            h = h * x.repeat(1, 1, 4)[..., :16].tanh()
        return torch.nn.functional.gelu(h) + x


def test_under_bf16_a_last_layer_that_runs_otherwise_than_the_measured_one_runs_every_layer():
    """Under autocast no block runs as a twin, so nothing compared the layers alike: the template
    and the last layer must recompute as the group's measured layer does. Here the last (and
    the left-out 4-6) run heavier: every layer runs, every block measured (it was 25 % low)."""
    model = _Deep(_Windowed)

    def step_fn(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch)
        loss.backward()

    stats = _deep_stats(model, step_fn)
    assert stats["probe_skipped"] == 0 and "blocks alike ran otherwise" in stats["probe_skips_refused"]
    assert "block 7's forward, recomputed, runs other ops than block 0's" in stats["probe_twins_refused"]


def test_a_sequential_keeps_its_names_while_layers_are_left_out():
    from collections import OrderedDict

    body = torch.nn.Sequential(OrderedDict((f"l{i}", _Layer(i)) for i in range(6)))
    model = torch.nn.Module()
    model.body = body
    blocks = [(f"body.l{i}", m) for i, m in enumerate(body)]
    with left_out(model, blocks, [3, 4]):
        assert list(body._modules) == ["l0", "l1", "l2", "l5"] and body.l5 is blocks[5][1] and body[3] is blocks[5][1]
    assert list(body._modules) == [f"l{i}" for i in range(6)]
