"""Compiled blocks under a planner (``planners.compiled``): each block's own forward compiled,
the checkpoint outside it, plans and lengths changing from step to step with no recompile, the
same losses and gradients as eager; what cannot be compiled safely refused in one line.

A compile costs seconds on this CPU: ``runs`` compiles one tiny model once for the module (the
blocks share one code object, so Dynamo compiles it once for every block), and the tests that
compile again reuse that graph (a block compiled in place: the same code, guards that hold)."""

import itertools

import pytest
import torch
from torch import nn

from mimose_cli.memory import build_meter
from mimose_cli.planners import Planner
from mimose_cli.planners.baselines.uniform import NoCheckpointingPolicy
from mimose_cli.planners.contract import Decision

from helpers import assert_tensors_close

BUDGET = 64 << 20
PLANS = [("keep", "keep", "keep"), ("recompute", "keep", "recompute"), ("keep", "recompute", "recompute"),
         ("recompute",) * 3, ("keep", "keep", "recompute"), ("recompute", "keep", "keep")]
LENGTHS = [9, 17, 9, 30, 23, 12]


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    """Tokens (batch, length) -> a scalar loss through three ``Block``s."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return h.pow(2).mean()


class Cycling(NoCheckpointingPolicy):
    """A plan per step from ``PLANS``, in turn: a different plan at every step."""

    def __init__(self, parts, **options):
        super().__init__(parts, **options)
        self._turn = itertools.count()

    def decide(self, input_size, context=None):
        return Decision(PLANS[next(self._turn) % len(PLANS)])


def _batch(length):
    return torch.randint(0, 50, (2, length), generator=torch.Generator().manual_seed(length))


def _train(model, planner, meter):
    """The six steps of ``LENGTHS``: losses, gradients per step, peaks above the step's start, plans."""
    losses, grads, peaks, plans = [], [], [], []
    with meter.activate():
        meter.track(model)
        for length in LENGTHS:
            batch = _batch(length)
            meter.track(batch)
            with meter.step() as mem, planner.step(input_size=tuple(batch.shape)) as info:
                loss = model(batch)
                loss.backward()
            losses.append(loss.item())
            grads.append([p.grad.clone() for p in model.parameters()])
            peaks.append(mem.peak_bytes - mem.start_bytes)  # the step's own: the kept gradients apart
            plans.append(info.plan)
            model.zero_grad(set_to_none=True)
    return losses, grads, peaks, plans


@pytest.fixture(scope="module")
def runs():
    """The same model and steps eager and compiled, on the allocator meter; the compiled
    planner's stats."""
    meter = build_meter("allocator", BUDGET)
    eager_model, compiled_model = Tiny(), Tiny()
    with Planner(eager_model, Cycling, BUDGET, blocks="layers.*", meter=meter) as planner:
        eager = _train(eager_model, planner, meter)
    with Planner(compiled_model, Cycling, BUDGET, blocks="layers.*", meter=meter, compile=True) as planner:
        compiled = _train(compiled_model, planner, meter)
        trained = planner.stats
        with torch.no_grad():  # evaluation between steps: a graph without gradients, compiled now
            compiled_model(_batch(11))
        stats = {**planner.stats, "compiles_in_training": trained["compiles"]}
    return eager, compiled, stats


def test_compiled_blocks_train_as_eager_ones_with_the_plans_changing(runs):
    (losses, grads, _, plans), (c_losses, c_grads, _, c_plans), _ = runs
    assert plans == c_plans and len(set(plans)) == len(PLANS)  # a different plan at every step
    assert c_losses == pytest.approx(losses, rel=1e-5)
    for step, (a, b) in enumerate(zip(grads, c_grads)):
        assert_tensors_close(a, b, f"step {step} gradient")


def test_no_recompile_after_the_warmup_as_lengths_and_plans_change(runs):
    """Steps 0 and 1 bring keep and recompute (the graphs Dynamo guards apart); steps 2-5 change
    the length and the mix of blocks checkpointed, and compile nothing. Evaluation's graph
    (without gradients), compiled between steps, is counted as a compile, not as a recompile
    after the warm-up."""
    *_, stats = runs
    assert stats["compiled_blocks"] is True
    assert stats["compiles_in_training"] >= 1 and stats["compile_s"] > 0
    assert stats["compiles"] == stats["compiles_in_training"] + 1
    assert stats["recompiles_after_warmup"] == 0


def test_the_compiled_blocks_ran_compiled(runs):
    """Fusion keeps fewer intermediates: the compiled steps' peaks differ from eager's (here
    lower, at the steps that keep blocks), which they could not if the blocks ran eagerly."""
    (_, _, peaks, plans), (_, _, c_peaks, _), _ = runs
    kept = [i for i, plan in enumerate(plans) if "keep" in plan]
    assert all(c_peaks[i] < peaks[i] for i in kept)


def test_a_block_compiled_in_place_is_planned_compiled_and_given_back(runs):
    """``block.compile()``: its compiled call is taken off while the planner is attached (it
    would compile the router) and put back on close; the block's forward is compiled with the
    user's options instead, and trains as eager does."""
    (losses, *_), _, _ = runs
    model = Tiny()
    for layer in model.layers:
        layer.compile(dynamic=True)
    own = [layer._compiled_call_impl for layer in model.layers]
    meter = build_meter("allocator", BUDGET)
    with Planner(model, Cycling, BUDGET, blocks="layers.*", meter=meter) as planner:
        assert all(layer._compiled_call_impl is None for layer in model.layers)
        assert planner.parts.compiled is not None
        c_losses = _train(model, planner, meter)[0]
    assert c_losses == pytest.approx(losses, rel=1e-5)
    assert [layer._compiled_call_impl for layer in model.layers] == own


def test_offloaded_compiled_blocks_train_as_eager_ones(runs):
    """An offloaded block's saved tensors go to host memory through saved-tensor hooks around the
    compiled block, as around an eager one: the same losses, and no recompile after the warm-up."""
    plans = [("keep", "offload", "keep"), ("offload", "recompute", "keep"), ("offload", "keep", "offload"),
             ("recompute",) * 3, ("keep", "offload", "recompute"), ("offload",) * 3]

    class Offloading(Cycling):
        def decide(self, input_size, context=None):
            return Decision(plans[next(self._turn) % len(plans)])

    meter = build_meter("allocator", BUDGET)
    eager_model, compiled_model = Tiny(), Tiny()
    with Planner(eager_model, Offloading, BUDGET, blocks="layers.*", meter=meter) as planner:
        losses = _train(eager_model, planner, meter)[0]
    with Planner(compiled_model, Offloading, BUDGET, blocks="layers.*", meter=meter, compile=True) as planner:
        c_losses = _train(compiled_model, planner, meter)[0]
        assert planner.stats["recompiles_after_warmup"] == 0
    assert c_losses == pytest.approx(losses, rel=1e-5)


def test_the_plan_cannot_change_inside_a_step():
    """A step's plan is fixed before its forward (a block run compiled in the forward and eagerly
    in its recompute would fail in backward, unsloth-zoo#1001): set_plan inside is refused."""
    model = Tiny()
    with Planner(model, Cycling, None, blocks="layers.*") as planner:
        with planner.step(input_size=(2, 8)):
            with pytest.raises(RuntimeError, match="between steps") as error:
                planner.set_plan(("recompute",) * 3)
            model(_batch(8)).backward()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("make, planner_options, message", [
    (lambda m: setattr(m, "layers", nn.ModuleList(torch.compile(layer) for layer in m.layers)), {},
     "block 'layers.0' is a torch.compile\\(block\\) wrapper"),
    (lambda m: m.compile(), {}, "the whole model is torch.compile'd"),
    (lambda m: None, {"compile": True, "plan_choices": "selective"}, "selective checkpointing cannot see"),
])
def test_what_cannot_be_compiled_safely_is_refused_in_one_line(make, planner_options, message):
    from mimose_cli.planners.mimose.policy import MimosePolicy

    model = Tiny()
    make(model)
    options = dict(planner_options)
    choices = options.pop("plan_choices", None)
    if choices:
        options.update(choices=choices, estimate="probes")
    with pytest.raises(ValueError, match=message) as error:
        Planner(model, MimosePolicy, "1GB", blocks="layers.*", meter=build_meter("allocator", 1 << 30), **options)
    assert "\n" not in str(error.value)


def test_a_selective_plan_for_compiled_blocks_is_refused_in_one_line():
    with Planner(Tiny(), Cycling, None, blocks="layers.*", compile=True) as planner:
        with pytest.raises(ValueError, match="cannot see inside compiled code") as error:
            planner.set_plan(("selective", "keep", "partial1"))
    assert "\n" not in str(error.value)


def test_a_planner_that_builds_its_meter_builds_the_allocator_one_compiled_or_not():
    from mimose_cli.planners.mimose.policy import Mimose

    for compile in (True, False):
        with Mimose(Tiny(), "1GB", blocks="layers.*", compile=compile) as planner:
            assert planner.meter.kind == "allocator"


def test_compile_under_the_dispatch_meter_is_said_to_run_eagerly():
    meter = build_meter("simulated", BUDGET)
    with pytest.warns(UserWarning, match="runs eagerly .* use meter 'allocator'"):
        Planner(Tiny(), Cycling, BUDGET, blocks="layers.*", meter=meter, compile=True).close()
