"""Out-of-memory recovery in the loop: a step that does not fit is retried on the same batch,
and the run trains exactly as if nothing had happened."""

import json

import pytest
import torch

import mimose_cli.launcher.step as trainer
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.train import run_training
from mimose_cli.memory.simulated import SimulatedMeter
from mimose_cli.planners import build_planner
from mimose_cli.planners.recovery import PlanOutOfMemoryError

from helpers import QUICK_OVERRIDES, QUICKSTART

STEPS = ["training.max_steps=8", "planner.mimose.sheltered_steps=3", "budget=40MB"]


class ShrinkingDevice(SimulatedMeter):
    """A simulated device that loses memory from its ``at``-th step on (another process took
    it, say): below what the planner, which still plans for the budget it was given, predicts."""

    at, to_bytes = 5, None

    def step(self):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.at:
            self.budget_bytes = self.to_bytes
        return super().step()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    runs = {name: run_training(load_recipe(QUICKSTART, QUICK_OVERRIDES + STEPS + [
        f"out_dir={out}", f"planner.name={name}"]), view="none") for name in ("mimose", "full")}
    return runs


def test_a_device_that_shrinks_mid_run_loses_no_batch_and_changes_no_loss(reference, quick_recipe, monkeypatch):
    full_peak = max(r.peak_bytes for r in reference["full"].records)
    ShrinkingDevice.to_bytes = int(full_peak * 1.02)  # full checkpointing still fits, mimose's plans not
    monkeypatch.setattr(trainer, "build_meter", lambda kind, budget, device: ShrinkingDevice(budget))
    result = run_training(quick_recipe(*STEPS, "planner.name=mimose"), view="none")
    records, expected = result.records, reference["mimose"].records
    assert result.summary["status"] == "completed"
    assert [r.input_size for r in records] == [r.input_size for r in expected]  # each batch once
    # Before the device shrinks both runs make the same plans: the same ops in the same order, so
    # the same losses bit for bit. After it, the retries checkpoint more blocks than the reference's
    # plans, whose gradients may differ in the last bits (helpers.assert_tensors_close says why).
    shrunk = ShrinkingDevice.at - 1
    assert [r.loss for r in records[:shrunk]] == [r.loss for r in expected[:shrunk]]
    assert [r.loss for r in records] == pytest.approx([r.loss for r in expected], rel=1e-5)
    assert sum(r.retries for r in records) > 0 and result.summary["retries"] == sum(r.retries for r in records)
    assert any(r.phase == "recovery" for r in records[ShrinkingDevice.at - 1:])
    assert result.summary["planner"]["full_sizes"] > 0
    lines = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["retries"] for line in lines] == [r.retries for r in records]


def test_a_step_that_never_fits_ends_the_run_with_the_three_figures(reference, quick_recipe, monkeypatch):
    ShrinkingDevice.to_bytes = int(min(r.peak_bytes for r in reference["full"].records) * 0.9)
    monkeypatch.setattr(trainer, "build_meter", lambda kind, budget, device: ShrinkingDevice(budget))
    result = run_training(quick_recipe(*STEPS, "planner.name=mimose"), view="none")
    last = result.records[-1]
    assert result.summary["status"] == "oom" and len(result.records) == ShrinkingDevice.at
    assert last.oom and last.retries == 2
    from mimose_cli.units import format_bytes

    assert "every block checkpointed" in last.error
    assert f"budget {format_bytes(ShrinkingDevice.to_bytes)}" in last.error  # the device's, not the plan's
    assert "predicted" in last.error and "reached" in last.error


def _tiny_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(),
                                                     torch.nn.Linear(128, 32)) for _ in range(4)])


def test_run_keeps_the_gradients_of_earlier_micro_batches_exactly(monkeypatch):
    """A failed backward may have written into gradients accumulated before it; the retry
    must leave them as if the failure never happened. Compared bit for bit: the clean and the
    recovered run apply the same ops in the same order to the kept gradients (the failed
    attempt's writes are undone, not compensated)."""
    data = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def accumulate(fail_second):
        model = _tiny_mlp()
        meter = SimulatedMeter(None)
        with meter.activate():
            meter.track(model)
            planner = build_planner("mimose", model, "1GB", meter=meter, sheltered_steps=1)
            failed = []

            def step_fn(x):
                loss = model(x).pow(2).mean()
                if fail_second and x is data[1] and not failed:
                    loss.backward(retain_graph=True)  # half the gradients written, then no room
                    failed.append(1)
                    raise torch.OutOfMemoryError("simulated")
                loss.backward()
                return loss.detach()

            for x in data:
                planner.run(step_fn, x, input_size=(16, 32))
            retries = planner.stats["retries"]
            planner.close()
        return [p.grad.clone() for p in model.parameters()], retries

    clean, _ = accumulate(False)
    recovered, retries = accumulate(True)
    assert retries == 1
    assert all(torch.equal(a, b) for a, b in zip(clean, recovered))


def test_none_does_not_adapt_so_it_fails_at_once():
    model = _tiny_mlp()
    meter = SimulatedMeter(None)
    with meter.activate():
        meter.track(model)
        x = torch.randn(64, 32)
        meter.budget_bytes = meter.current_bytes() + 10_000
        planner = build_planner("none", model, "1GB", meter=meter)
        with pytest.raises(PlanOutOfMemoryError, match="ran out of memory. After 0 retries, the last with 0 of 4 blocks"):
            planner.run(lambda x: model(x).sum().backward(), x, input_size=(64, 32))
        assert planner.stats["retries"] == 0
        planner.close()
