"""A planner that builds its own meter (Mimose in a loop of the user's) changes nothing outside
its steps: memory, speed and errors there are what they would be without it; inside a step the
budget holds as before."""

import contextlib

import pytest
import torch

import mimose_cli
from mimose_cli.memory import build_meter
from mimose_cli.torch_private import dispatch_modes

from helpers import bert_batch, tiny_bert

BUDGET = 4 * 2**20  # the tiny BERT's steps below peak near 1.1 MiB
SIZES = [(2, 16), (2, 32), (2, 24), (2, 40)]


def error_of(action):
    """(type, message) of what ``action()`` raises."""
    try:
        action()
    except Exception as error:  # any error: it must be the same with the planner open
        return type(error), str(error)
    raise AssertionError("expected an error")


def user_errors():
    """Errors of code that has nothing to do with the planner: an allocation no machine can
    serve, and a shape mismatch."""
    return [error_of(lambda: torch.empty(2**50, dtype=torch.uint8)),
            error_of(lambda: torch.ones(2, 3) @ torch.ones(2, 3))]


def train(planner, model, optimizer, meter=None):
    """The user's loop: a planned forward+backward, the optimizer step outside it; with a
    ``meter`` of the loop's own, each step measured by it as the training loop does. Returns
    (phase, plan, predicted peak, measured peak) per step."""
    seen = []
    for size in SIZES:
        batch = bert_batch(*size)
        torch.manual_seed(0)
        with meter.step() if meter else contextlib.nullcontext(), planner.step(batch) as info:
            model(**batch).loss.backward()
        seen.append((info.phase, info.plan, info.predicted_peak_bytes, planner.meter.peak_bytes()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return seen


@pytest.mark.parametrize("cpu_meter", ["allocator", "simulated"])
def test_an_open_planner_changes_nothing_between_its_steps(cpu_meter, monkeypatch):
    monkeypatch.setattr(mimose_cli.memory, "CPU_DEFAULT", cpu_meter)  # the meter the planner builds
    expected_errors = user_errors()
    resize = torch.UntypedStorage.resize_
    model = tiny_bert()
    planner = mimose_cli.Mimose(model, budget=BUDGET, sheltered_steps=2)  # left open
    try:
        with planner.step(bert_batch(2, 16)):
            before = planner.meter.current_bytes()
            made = torch.empty(1000, dtype=torch.uint8)
            inside = planner.meter.current_bytes() - before
            del made
            model(**bert_batch(2, 16)).loss.backward()
        assert planner.meter.kind == cpu_meter
        train(planner, model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert inside == 1000 and dispatch_modes() == []  # speed: no mode sees the ops out here
        assert torch.UntypedStorage.resize_ is resize
        counted = planner.meter.current_bytes()
        big = torch.empty(10 * BUDGET, dtype=torch.uint8)  # far over the budget: allowed out here
        product = torch.randn(256, 256) @ torch.randn(256, 256)
        assert planner.meter.current_bytes() == counted  # memory: nothing counted out here
        del big, product
        assert planner.meter.current_bytes() == counted
        assert user_errors() == expected_errors
    finally:
        planner.close()


def test_the_budget_still_holds_inside_a_step():
    model = tiny_bert()
    with mimose_cli.Mimose(model, budget=BUDGET, sheltered_steps=2) as planner:
        with pytest.raises(torch.OutOfMemoryError, match="simulated device out of memory"):
            with planner.step(bert_batch(2, 16)):
                torch.empty(BUDGET + 1, dtype=torch.uint8)
        assert dispatch_modes() == []  # a step that raised turned the meter off as well
        attempts = []

        def step_fn(batch):  # the first attempt runs out of memory; run() undoes it and retries
            attempts.append(len(attempts))
            if len(attempts) == 1:
                torch.empty(BUDGET + 1, dtype=torch.uint8)
            model(**batch).loss.backward()

        planner.run(step_fn, bert_batch(2, 16))
        assert attempts == [0, 1] and planner.last.retries == 1 and dispatch_modes() == []


def test_frees_between_steps_are_seen_and_nothing_is_counted_twice():
    model = tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters())
    with mimose_cli.Mimose(model, budget=BUDGET, sheltered_steps=2) as planner:
        planner.track(optimizer)
        weights = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
        for size in SIZES[:3]:
            with planner.step(bert_batch(*size)):
                model(**bert_batch(*size)).loss.backward()
            grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
            optimizer.step()
            state = sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values())
            optimizer.zero_grad(set_to_none=True)  # freed out here: the count drops at once
            # The state appeared out here: counted from the next step's start on, once.
            counted = weights + (state if size != SIZES[0] else 0)
            assert planner.meter.current_bytes() == counted, size
        assert grads and state


@pytest.mark.parametrize("optimizer_tracked", [True, False])
def test_a_tracked_optimizer_counts_as_on_a_meter_kept_on(optimizer_tracked):
    """The training loop's way (a meter on for the whole loop sees the optimizer's state appear)
    and the library's (the planner's own meter, on in its steps, the optimizer tracked) see the
    same peaks and make the same plans; untracked, the state is missing from the peaks."""
    model = tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters())
    with mimose_cli.Mimose(model, budget=BUDGET, sheltered_steps=2) as planner:
        if optimizer_tracked:
            planner.track(optimizer)
        library = train(planner, model, optimizer)
    state = sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values())

    model = tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters())
    meter = build_meter("auto", BUDGET)  # the kind the planner builds for itself
    with meter.activate():
        meter.track(model)
        with mimose_cli.Mimose(model, budget=BUDGET, sheltered_steps=2, meter=meter) as planner:
            kept_on = train(planner, model, optimizer, meter)
    if optimizer_tracked:
        assert library == kept_on
    else:  # the first step has no state yet; every later one misses it
        assert library[0] == kept_on[0]
        assert [peak + state for *_, peak in library[1:]] == [peak for *_, peak in kept_on[1:]]


def test_a_planner_is_a_context_manager_closed_on_an_error_and_closes_once():
    model = tiny_bert()
    with pytest.raises(KeyError):
        with mimose_cli.Mimose(model, budget=BUDGET) as planner:
            assert "forward" in vars(model.bert.encoder.layer[0])  # the router is in place
            raise KeyError("the user's error")
    assert all("forward" not in vars(block) for block in model.bert.encoder.layer)
    model.config.use_cache = False  # the user's setting after close(): a second close keeps it
    planner.close()
    assert model.config.use_cache is False


def test_a_forward_between_steps_is_not_checkpointed_by_the_last_plan():
    from mimose_cli.memory import SavedBytesCounter

    def saved_bytes(model, batch):
        counter = SavedBytesCounter(exclude=model.parameters())
        with counter:
            loss = model(**batch).loss
        loss.backward()
        return counter.bytes

    batch = bert_batch(2, 32)
    model = tiny_bert()
    plain = saved_bytes(model, batch)
    with mimose_cli.FullCheckpointing(model) as planner:  # every block in the plan
        with planner.step(batch):
            in_step = saved_bytes(model, batch)
        assert planner.plan == ("recompute",) * planner.num_blocks  # still the plan in force...
        assert in_step < plain and saved_bytes(model, batch) == plain  # ...but applied only in steps
