import re
import time

import pytest
import torch
from torch import nn

from mimose_cli.planners import build_planner, infer_input_size
from mimose_cli.planners.blocks import discover_blocks


class Stack(nn.Module):
    def __init__(self, width=16, depth=4):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Dropout(0.3), nn.GELU()) for _ in range(depth))
        self.head = nn.ModuleList([nn.Linear(width, 2)])

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head[0](x).sum()


def test_discovers_longest_homogeneous_modulelist():
    names = [n for n, _ in discover_blocks(Stack(depth=5))]
    assert names == [f"layers.{i}" for i in range(5)]


def test_glob_selects_blocks_and_bad_glob_names_modules():
    model = Stack()
    assert [n for n, _ in discover_blocks(model, "layers.[12]")] == ["layers.1", "layers.2"]
    with pytest.raises(ValueError, match="matches no module"):
        discover_blocks(model, "encoder.*")


def test_discovers_hf_checkpoint_layers():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=32)
    names = [n for n, _ in discover_blocks(BertModel(config))]
    assert names == [f"encoder.layer.{i}" for i in range(3)]


@pytest.mark.parametrize("batch, size", [
    ({"input_ids": torch.zeros(4, 3, 17)}, (12, 17)),
    ({"input_ids": torch.zeros(8, 33)}, (8, 33)),
    ({"pixel_values": torch.zeros(2, 3, 32, 48)}, (2, 32, 48)),
])
def test_input_size_folds_leading_dims(batch, size):
    assert infer_input_size(batch) == size


def test_input_size_error_says_how_to_fix():
    with pytest.raises(ValueError, match="input_size"):
        infer_input_size({"labels": torch.zeros(3)})


def _grads(planner_name, seed=0):
    torch.manual_seed(0)
    model = Stack()
    planner = build_planner(planner_name, model)
    torch.manual_seed(seed)
    x = torch.randn(8, 16)
    with planner.step(input_size=(8, 16)) as info:
        loss = model(x)
        loss.backward()
    planner.close()
    return loss.item(), [p.grad.clone() for p in model.parameters()], info.plan, model


def test_full_checkpoints_every_block_and_matches_none_exactly_with_dropout():
    """Bit for bit: each block of ``Stack`` feeds only the next and shares no tensor with
    another, so the recomputed forward (the same RNG state, so the same dropout masks) and the
    backward run the same kernels on the same values and sum every gradient in the same order
    as the plain step."""
    loss_none, grads_none, plan_none, _ = _grads("none")
    loss_full, grads_full, plan_full, _ = _grads("full")
    assert plan_none == ("keep",) * 4 and plan_full == ("recompute",) * 4
    assert loss_none == loss_full
    assert all(torch.equal(a, b) for a, b in zip(grads_none, grads_full))


def test_full_recomputes_blocks_in_backward():
    model = Stack()
    calls = []
    model.layers[0][0].register_forward_hook(lambda *a: calls.append(1))
    planner = build_planner("full", model)
    with planner.step(input_size=(2, 16)):
        model(torch.randn(2, 16)).backward()
    assert len(calls) == 2  # forward once, recomputed once in backward
    planner.close()
    calls.clear()
    model(torch.randn(2, 16)).backward()
    assert len(calls) == 1  # close() restored the plain forward


@pytest.mark.parametrize("name", ["none", "full", "sublinear", "dtr", "offload"])
def test_a_planner_without_phases_leaves_the_steps_phase_empty(name):
    """Phases are Mimose's (sheltered, measuring, responsive, untrusted): another planner's step
    has none, so its records and lines do not borrow Mimose's words."""
    model = Stack()
    planner = build_planner(name, model)
    if name == "sublinear":
        planner.prepare(lambda size: torch.randn(*size), (2, 16))
    with planner.step(input_size=(2, 16)):
        model(torch.randn(2, 16)).backward()
    assert planner.last.phase is None
    planner.close()


@pytest.mark.parametrize("sizes, named", [
    ({"budget": 1_000_000, "safety_margin": -500_000}, "safety_margin=-500000"),
    ({"budget": "1MB", "safety_margin": "-500KB"}, "safety_margin='-500KB'"),
    ({"budget": -1_000_000}, "budget=-1000000"),
    ({"budget": "1MB", "safety_margin": "1MB"}, "safety_margin='1MB' leaves nothing of budget='1MB'"),
], ids=["margin", "margin-text", "budget", "margin-the-whole-budget"])
def test_a_negative_budget_or_margin_is_refused_naming_it(sizes, named):
    """Before, a margin of -500 kB was taken as 500 kB of room beyond the budget."""
    with pytest.raises(ValueError, match=re.escape(named)):
        build_planner("mimose", Stack(), **sizes)


def test_unknown_planner_lists_choices():
    with pytest.raises(ValueError, match="none"):
        build_planner("nope", Stack())


class Slow(nn.Module):
    """A block whose forward takes at least ``seconds``: its recompute is timeable."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        time.sleep(self.seconds)
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("name, recomputed", [("none", 0), ("full", 3)])
def test_recompute_time_counts_only_backward_recomputation(name, recomputed):
    model = nn.Sequential(*(Slow(0.02) for _ in range(3)))
    planner = build_planner(name, model, blocks="*")
    with planner.step(input_size=(2, 16)) as info:
        model(torch.randn(2, 16, requires_grad=True)).sum().backward()
    planner.close()
    # three forwards and `recomputed` recomputes each slept 20 ms; only the recomputes count
    assert recomputed * 20 <= info.recompute_ms < recomputed * 20 + 40


@pytest.mark.parametrize("name", ["none", "full", "mimose"])
def test_key_value_cache_is_off_while_attached_and_restored_on_close(name):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32))
    assert model.config.use_cache is True
    planner = build_planner(name, model, "1GB")
    assert model.config.use_cache is False
    ids = torch.randint(0, 64, (2, 8))
    with planner.step({"input_ids": ids}):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    assert out.past_key_values is None  # no cache built during training
    planner.close()
    assert model.config.use_cache is True


def test_the_policy_is_told_the_step_in_its_context_and_nothing_is_left_on_the_planner():
    """``decide(size, context)``: the step's batch, the attempt (a retry after running out of
    memory is attempt 1) and ``run``'s step function; no attribute of the planner carries them."""
    from mimose_cli.planners import Decision, Planner, Policy

    class Recording(Policy):
        name = "recording"

        def __init__(self, parts):
            super().__init__(parts)
            self.contexts = []

        def decide(self, input_size, context):
            self.contexts.append(context)
            return Decision(("keep",) * self.parts.num_blocks)

        def recover(self, info, failures, reached_bytes):
            return True  # its own remedy, so the retry is its to decide (not every block for good)

    model = Stack()
    batch = torch.randn(2, 16)
    failed = []

    def step_fn(x):
        if not failed:
            failed.append(True)
            raise torch.OutOfMemoryError("simulated")
        model(x).backward()

    with Planner(model, Recording) as planner:
        with planner.step(batch, input_size=(2, 16)):
            model(batch).backward()
        planner.run(step_fn, batch, input_size=(2, 16))
        first, *retried = planner.policy.contexts
        assert first.batch is batch and first.attempt == 0 and first.step_fn is None
        assert [(c.batch is batch, c.attempt, c.step_fn is step_fn) for c in retried] == [(True, 0, True), (True, 1, True)]
        assert not any(hasattr(obj, name) for obj in (planner, planner.policy, planner.parts)
                       for name in ("batch", "attempt", "step_fn"))
