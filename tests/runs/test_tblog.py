"""training.tensorboard: each step's scalars in runs/<id>/tensorboard/, equal to metrics.jsonl."""

import sys

import pytest

import mimose_cli.launcher.train
from mimose_cli.launcher.recipe import RecipeError
from mimose_cli.planners.blocks import checkpointed
from mimose_cli.runs.records import read_records


def scalars(log_dir) -> dict:
    """{tag: [(step, value)]} of the event files in ``log_dir``, read back as TensorBoard does."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_the_logged_scalars_are_the_metrics(quick_recipe):
    recipe = quick_recipe("training.tensorboard=true", "training.max_steps=7", "data.validation_examples=8",
                          "training.eval_every=3", "planner.mimose.choices=offload")
    run_dir = mimose_cli.launcher.train.run_training(recipe, view="none").run_dir
    records = read_records(run_dir / "metrics.jsonl")
    logged = scalars(run_dir / "tensorboard")
    assert logged["train/loss"] == [(r.step, pytest.approx(r.loss)) for r in records]
    assert logged["memory/peak_bytes"] == [(r.step, pytest.approx(r.peak_bytes)) for r in records]
    assert logged["planner/checkpointed_blocks"] == [(r.step, len(checkpointed(r.plan))) for r in records]
    assert logged["planner/offloaded_blocks"] == [(r.step, r.plan.count("offload")) for r in records]
    assert logged["planner/selective_blocks"] == [(r.step, r.plan.count("selective")) for r in records]
    offloaded = [(r.step, pytest.approx(r.host_peak_bytes)) for r in records if "offload" in r.plan]
    assert logged["memory/host_peak_bytes"] == offloaded
    assert any("offload" in r.plan for r in records)
    assert all(bool(r.host_peak_bytes) == ("offload" in r.plan) for r in records)
    # Mimose predicts once past its 5 sheltered steps.
    # Planned from the first step (the probes' estimate): every step has a prediction.
    assert [step for step, _ in logged["memory/predicted_peak_bytes"]] == list(range(7))
    assert logged["eval/loss"] == [(r.step, pytest.approx(r.eval_loss)) for r in records if r.eval_loss is not None]
    assert [step for step, _ in logged["eval/loss"]] == [2, 5, 6]  # every 3 steps, and after the last
    assert {"train/lr", "time/iter_ms", "planner/retries", "eval/accuracy"} <= set(logged)


def test_off_by_default_and_without_the_package_a_recipe_error(quick_recipe, monkeypatch):
    run_dir = mimose_cli.launcher.train.run_training(quick_recipe("training.max_steps=1"), view="none").run_dir
    assert not (run_dir / "tensorboard").exists()
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(RecipeError, match=r"training\.tensorboard=True is invalid.*pip install tensorboard"):
        quick_recipe("training.tensorboard=true")


def test_a_resumed_run_logs_each_step_once(quick_recipe):
    from mimose_cli.launcher.resume import resume_recipe

    first = mimose_cli.launcher.train.run_training(quick_recipe("training.tensorboard=true", "training.max_steps=3"),
                                          view="none").run_dir
    at_step_3 = (first / "checkpoint.pt").read_bytes()
    mimose_cli.launcher.train.run_training(resume_recipe(first, ["training.max_steps=5"]), view="none", resume=first)
    # As if that resume had been killed after step 4 before writing a checkpoint: resume from step 3 again.
    (first / "checkpoint.pt").write_bytes(at_step_3)
    mimose_cli.launcher.train.run_training(resume_recipe(first, ["training.max_steps=5"]), view="none", resume=first)
    records = read_records(first / "metrics.jsonl")
    assert [r.step for r in records] == [0, 1, 2, 3, 4]
    assert scalars(first / "tensorboard")["train/loss"] == [(r.step, pytest.approx(r.loss)) for r in records]
