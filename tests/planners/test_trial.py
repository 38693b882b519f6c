"""planners/trial.py: the probe steps a planner runs before its first step leave no trace, and a
step function doing what they cannot undo (an optimizer step, another planner's step) is refused
in one line before it happens."""

from pathlib import Path

import pytest
import torch

import mimose_cli
from mimose_cli.planners import build_planner
from mimose_cli.planners.inputs import resized_batch
from mimose_cli.planners.trial import ProbeRefused

from helpers import bert_batch, tiny_bert


def _state(model, optimizer) -> dict:
    """Copies of everything a probe could leave a trace in: weights, gradients, buffers, the RNG
    and the optimizer's state and settings."""
    def copy(tensors):
        return [None if t is None else t.detach().clone() for t in tensors]

    params = list(model.parameters())
    return {"weights": copy(params), "grads": copy(p.grad for p in params), "buffers": copy(model.buffers()),
            "rng": torch.get_rng_state(),
            "optimizer": [{k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
                          for p in params],
            "groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]}


def _assert_same(state, before) -> None:
    """Bit for bit: nothing was computed into these tensors in between, so any change is a trace."""
    for key in ("weights", "grads", "buffers"):
        assert len(state[key]) == len(before[key])
        for now, then in zip(state[key], before[key]):
            assert (now is None) == (then is None), key
            assert now is None or torch.equal(now, then), key
    assert torch.equal(state["rng"], before["rng"])
    assert state["groups"] == before["groups"]
    assert len(state["optimizer"]) == len(before["optimizer"])
    for now, then in zip(state["optimizer"], before["optimizer"]):
        assert now.keys() == then.keys()
        assert all(torch.equal(now[k], then[k]) if torch.is_tensor(now[k]) else now[k] == then[k] for k in now)


def _trained_once(model):
    """A tracked AdamW that has stepped once (so it has state), and gradients of a micro-batch
    pending (accumulation): what the probes of the next step must leave as they are."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**bert_batch(2, 16)).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model(**bert_batch(2, 20)).loss.backward()
    return optimizer


def _own_loop(name: str) -> tuple:
    """The state before ``run``, at the real step's call and after ``run``, for planner ``name`` in
    a loop of one's own (no ``prepare``; a tracked AdamW, gradients of a micro-batch pending)."""
    model = tiny_bert(2)
    optimizer = _trained_once(model)
    seen = []

    def step_fn(batch):
        seen.append(_state(model, optimizer))
        model(**batch).loss.backward()

    with build_planner(name, model, "1GB") as planner:
        planner.track(optimizer)
        before = _state(model, optimizer)
        planner.run(step_fn, bert_batch(4, 32))
        assert planner.last.plan == ("keep", "keep")  # the same ops as without a planner
    return before, seen, _state(model, optimizer)


def test_the_probes_of_a_loop_of_ones_own_leave_no_trace():
    """Mimose's ``planner.run(step_fn, batch)`` without ``prepare`` probes first, calling
    ``step_fn`` on cut batches; the ``none`` planner does not. At the real step's call and after
    ``run`` the weights, gradients, buffers, RNG and the tracked AdamW are bit for bit the same in
    both: the real step keeps every block, so it runs the same ops in the same order on the same
    inputs, and the probes put back what they touched instead of recomputing it."""
    before, seen, after = _own_loop("mimose")
    plain_before, plain_seen, plain_after = _own_loop("none")
    assert len(seen) == 4 and len(plain_seen) == 1  # three probe steps, then the real one
    _assert_same(before, plain_before)
    _assert_same(seen[-1], plain_seen[0])
    _assert_same(after, plain_after)


@pytest.mark.parametrize("prepared", [False, True], ids=["own-loop", "prepare"])
def test_an_optimizer_step_in_the_step_function_is_refused_before_it_happens(prepared):
    """A step function that steps the optimizer would step it on every cut probe batch too: it is
    refused in one line naming the fix, at the first probe's ``optimizer.step()``, before the step,
    and the probe leaves everything as it was (bit for bit: nothing written into it)."""
    model = tiny_bert(2)
    optimizer = _trained_once(model)
    batch = bert_batch(4, 32)

    def step_fn(batch):
        model(**batch).loss.backward()
        optimizer.step()

    with mimose_cli.Mimose(model, budget="1GB") as planner:
        planner.track(optimizer)
        before = _state(model, optimizer)
        with pytest.raises(ProbeRefused, match=r"^AdamW.step\(\) inside a planner's probe step: .* step the "
                                               r"optimizer after planner.run returns") as refused:
            if prepared:
                planner.prepare(lambda size: resized_batch(batch, size), (4, 32), step_fn=step_fn)
            else:
                planner.run(step_fn, batch)
    assert "\n" not in str(refused.value) and "planner.prepare(make_batch, max_input_size)" in str(refused.value)
    _assert_same(_state(model, optimizer), before)
    optimizer.step()  # outside a probe an optimizer steps as ever


def test_a_planner_inside_another_planners_step_function_is_refused():
    """A second model's planner run inside the first one's step function would run its backward on
    every cut probe batch too (its gradients 4.5x too large): refused in one line, before that
    planner's step, its model's gradients untouched."""
    outer_model, inner_model = tiny_bert(2), tiny_bert(2, seed=1)
    inner = build_planner("none", inner_model, "1GB")

    def inner_step(batch):
        inner_model(**batch).loss.backward()

    def step_fn(batch):
        inner.run(inner_step, batch)
        outer_model(**batch).loss.backward()

    with mimose_cli.Mimose(outer_model, budget="1GB") as outer, inner:
        with pytest.raises(ProbeRefused, match=r"^planner.run inside a planner's probe step: .* the outer "
                                               r"planner.prepare\(make_batch, max_input_size\)") as refused:
            outer.run(step_fn, bert_batch(4, 32))
        assert inner.steps == 0
    assert "\n" not in str(refused.value)
    assert all(p.grad is None for p in [*inner_model.parameters(), *outer_model.parameters()])


@pytest.mark.parametrize("layers, probe_calls", [(2, 3), (8, 4)])
def test_the_step_function_sees_as_many_probe_calls_as_the_docs_say(layers, probe_calls):
    """docs/MIMOSE.md and docs/HF_TRAINER.md: before the first step the probes call the step
    function three times (the plain probe step and the two measured ones), four where a long
    stack's middle layers are left out (the check with one layer more)."""
    model = tiny_bert(layers)
    calls = []

    def step_fn(batch):
        calls.append(batch["input_ids"].shape)
        model(**batch).loss.backward()

    with mimose_cli.Mimose(model, budget="1GB") as planner:
        planner.run(step_fn, bert_batch(4, 32))
        assert (planner.stats["probe_skipped"] > 0) == (layers == 8)
    assert len(calls) == probe_calls + 1 and calls[-1] == (4, 32)
    said = " ".join((Path(__file__).resolve().parents[2] / "docs" / "MIMOSE.md").read_text().split())
    assert ("The probes call the step function three times before the first step" in said
            and "four times where a long stack's middle layers are left out" in said)
