import json
import os

import pytest
import torch
from typer.testing import CliRunner

from mimose_cli.cli import app
from mimose_cli.launcher import step
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.train import run_training
from mimose_cli.memory import build_meter
from mimose_cli.planners.blocks import checkpointed
from mimose_cli.runs.rundir import load_run

from helpers import QUICK_OVERRIDES, QUICKSTART, require_allocator

ROOMY = "1GB"
# A few seconds' run: 8 steps of 2 questions x 2 choices, up to 64 tokens. At TIGHT the longest
# batches need checkpointing (none peaks at 9.8 MB on them), the shorter ones not.
TINY = ["training.max_steps=8", "training.batch_size=2", "data.num_examples=32", "data.num_choices=2",
        "data.max_length=64"]
TIGHT = "8MB"


def _run(recipe):
    return run_training(recipe, view="none")


@pytest.fixture(scope="module")
def roomy_runs(tmp_path_factory):
    """`none` and `full` on the same quickstart steps with a budget that never binds."""
    out = tmp_path_factory.mktemp("runs")
    runs = {}
    for name in ("none", "full"):
        recipe = load_recipe(QUICKSTART, QUICK_OVERRIDES + [f"out_dir={out}", f"planner.name={name}",
                                                            f"budget={ROOMY}"])
        runs[name] = _run(recipe)
    return runs


def test_run_directory_is_complete(roomy_runs):
    result = roomy_runs["full"]
    files = {p.name for p in result.run_dir.iterdir()}
    assert {"recipe.yaml", "env.json", "metrics.jsonl", "plans.jsonl", "summary.json"} <= files
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6
    record = json.loads(lines[0])
    for key in ("step", "input_shape", "loss", "iter_ms", "memory/peak_bytes", "plan", "planner_ms"):
        assert key in record
    assert record["plan"] == ["recompute"] * record["num_blocks"]
    assert result.summary["status"] == "completed" and result.summary["steps"] == 6


def test_loss_identical_between_none_and_full_with_dropout(roomy_runs):
    losses_none = [r.loss for r in roomy_runs["none"].records]
    losses_full = [r.loss for r in roomy_runs["full"].records]
    assert len(losses_none) == 6 and len(set(losses_none)) > 1
    for a, b in zip(losses_none, losses_full):
        assert abs(a - b) <= 1e-6 * abs(a)
    assert roomy_runs["full"].summary["peak_bytes"] < roomy_runs["none"].summary["peak_bytes"]


def test_none_runs_out_of_memory_where_full_fits(roomy_runs, quick_recipe):
    # A budget between full's and none's peaks on these very steps.
    tight = (roomy_runs["full"].summary["peak_bytes"] + roomy_runs["none"].summary["peak_bytes"]) // 2
    none = _run(quick_recipe("planner.name=none", f"budget={tight}"))
    full = _run(quick_recipe("planner.name=full", f"budget={tight}"))
    assert none.summary["status"] == "oom" and none.summary["oom_steps"] == 1
    last = json.loads((none.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["oom"] and "out of memory" in last["error"]
    assert (none.run_dir / "summary.json").exists()
    assert full.summary["status"] == "completed"
    assert full.summary["peak_bytes"] <= tight


def test_resolved_recipe_reruns_the_same_run(roomy_runs):
    first = roomy_runs["none"]
    again = _run(load_recipe(first.run_dir / "recipe.yaml"))
    assert [r.loss for r in first.records] == [r.loss for r in again.records]  # same ops, same order
    assert [r.input_shape for r in first.records] == [r.input_shape for r in again.records]


def test_report_reads_an_interrupted_run(roomy_runs, tmp_path):
    import shutil

    run_dir = tmp_path / "cut"
    shutil.copytree(roomy_runs["none"].run_dir, run_dir)
    (run_dir / "summary.json").unlink()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "torn')  # a line cut off by the interruption
    summary, records = load_run(run_dir)
    assert summary["status"] == "interrupted"
    assert summary["steps"] == 6 and len(records) == 6
    assert summary["budget_bytes"] == 10**9


def test_cuda_device_without_gpu_is_a_clear_error(quick_recipe):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        _run(quick_recipe(device="cuda"))


@pytest.mark.parametrize("make, moments", [
    (lambda params: torch.optim.AdamW(params, lr=0.1), 2),
    (lambda params: torch.optim.Adam(params, lr=0.1, amsgrad=True), 3),
    (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 1),
    (lambda params: torch.optim.SGD(params, lr=0.1), 0),
])
def test_optimizer_state_bytes_matches_the_state_its_first_step_allocates(make, moments):
    from mimose_cli.launcher.preflight import optimizer_state_bytes

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    optimizer = make(model.parameters())
    expected = optimizer_state_bytes(optimizer)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    allocated = sum(t.numel() * t.element_size() for state in optimizer.state.values()
                    for name, t in state.items() if name != "step" and isinstance(t, torch.Tensor))
    assert expected == allocated == moments * sum(p.numel() * 4 for p in model.parameters())


def test_optimizer_state_bytes_warns_for_an_unknown_optimizer():
    from mimose_cli.launcher.preflight import optimizer_state_bytes

    optimizer = torch.optim.Adagrad(torch.nn.Linear(2, 2).parameters())
    with pytest.warns(UserWarning, match="Adagrad"):
        assert optimizer_state_bytes(optimizer) == 0


def test_trainer_reserves_the_adamw_state_for_a_static_plan(quick_recipe):
    from mimose_cli.launcher.models import build_model

    recipe = quick_recipe("planner.name=sublinear", "training.max_steps=1")
    params = sum(p.numel() * p.element_size() for p in build_model(recipe).parameters())
    result = run_training(recipe, view="none")
    assert result.summary["planner"]["reserve_bytes"] == 2 * params


def test_records_separate_the_optimizer_step_from_the_planned_peak(quick_recipe):
    """GPT-2's large embedding makes AdamW's first step (allocating its state) the iteration's
    peak; the forward/backward peak is what the oracle predicts."""
    recipe = quick_recipe("task=causal_lm", "model.type=gpt2", "planner.name=oracle", "budget=1GB",
                          "training.max_steps=2", "training.batch_size=2")
    records = run_training(recipe, view="none").records
    first = records[0]
    assert first.fwd_bwd_peak_bytes < first.peak_bytes
    for record in records:
        assert abs(record.fwd_bwd_peak_bytes - record.predicted_peak_bytes) <= 1e-3 * record.fwd_bwd_peak_bytes


def test_a_budget_below_the_model_state_fails_before_the_first_step(quick_recipe, tmp_path):
    from typer.testing import CliRunner

    from mimose_cli.cli import app
    from mimose_cli.runs.rundir import load_run

    result = CliRunner().invoke(app, ["train", str(QUICKSTART), *QUICK_OVERRIDES, "budget=1MB",
                                      f"out_dir={tmp_path / 'runs'}"])
    assert result.exit_code == 1
    assert "cannot hold the model's state" in result.output and "AdamW state" in result.output
    run = next((tmp_path / "runs").iterdir())
    summary, records = load_run(run)
    assert records == [] and summary["status"] == "oom" and summary["steps"] == 0
    assert "raise the budget" in summary["error"].lower()


def test_gradient_accumulation_plans_every_micro_batch_and_steps_once_per_window(quick_recipe):
    recipe = quick_recipe("training.gradient_accumulation_steps=2", "training.max_steps=3",
                          "planner.mimose.sheltered_steps=2", "budget=40MB")
    result = run_training(recipe, view="none")
    records = result.records
    assert result.summary["status"] == "completed"
    assert [(r.step, r.micro_step) for r in records] == [(s, m) for s in range(3) for m in range(2)]
    # The learning rate a step used moves once per optimizer step, not per micro-batch.
    assert records[0].lr == records[1].lr != records[2].lr == records[3].lr
    # Linear warmup from 0, as transformers' schedule (the Hugging Face Trainer's) has it.
    warmup, lr = recipe.training.warmup_steps, recipe.training.lr
    assert [r.lr for r in records[::2]] == pytest.approx([lr * step / warmup for step in range(3)])
    # Gradients of the first micro-batch are live at the second's start; predictions hold.
    responsive = [r for r in records if r.phase == "responsive"]
    assert any(r.micro_step == 1 for r in responsive)
    assert all(r.predicted_peak_bytes >= r.fwd_bwd_peak_bytes for r in responsive)


def test_bf16_runs_under_the_cpus_autocast(quick_recipe):
    fp32 = run_training(quick_recipe("planner.name=none", "budget=1GB", "training.max_steps=1"), view="none")
    bf16 = run_training(quick_recipe("planner.name=none", "budget=1GB", "training.max_steps=1",
                                     "training.precision=bf16"), view="none")
    assert bf16.summary["status"] == "completed"
    # Matmul activations saved in bf16 take half the bytes (softmax and losses stay fp32):
    # autocast is on, not ignored with a warning as it was on the CPU.
    assert bf16.records[0].activation_bytes < 0.9 * fp32.records[0].activation_bytes


def test_the_optimizer_steps_scratch_is_left_room_for_before_the_first_step(quick_recipe):
    from mimose_cli.launcher.models import build_model

    params = sum(p.numel() * p.element_size() for p in build_model(quick_recipe()).parameters())
    # Holds weights, gradients and AdamW's two moments, not the scratch of its step on top.
    result = run_training(quick_recipe(f"budget={int(4.5 * params)}"), view="none")
    assert result.summary["status"] == "oom" and result.summary["steps"] == 0
    assert "scratch" in result.summary["error"]


def _train_tight(tmp_path, planner, *overrides):
    """``mimose train`` of the quickstart cut to TINY at TIGHT; checks the run completed within
    the budget and returns its metrics.jsonl lines, summary.json and directory."""
    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["train", str(QUICKSTART), "--planner", planner, "--budget", TIGHT,
                                      "--out", str(out), "--view", "none", *TINY, *overrides])
    assert result.exit_code == 0, result.output
    (run_dir,) = out.iterdir()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == len(lines) == 8
    assert summary["budget_bytes"] == 8 * 10**6 and summary["over_budget_steps"] == 0
    assert all(line["memory/peak_bytes"] <= summary["budget_bytes"] for line in lines)
    return lines, summary, run_dir


def test_mimose_plans_from_the_first_step_each_input_size_within_the_budget(tmp_path):
    lines, summary, run_dir = _train_tight(tmp_path, "mimose")
    assert all(line["phase"] == "responsive" for line in lines)  # no step measured
    assert any(checkpointed(line["plan"]) for line in lines) and any(not checkpointed(line["plan"]) for line in lines)
    assert all(line["memory/peak_bytes"] <= line["predicted_peak_bytes"] for line in lines)
    stats = summary["planner"]
    assert stats["estimate_source"] == "probes" and stats["estimate_fallback"] == ""
    assert stats["underpredictions"] == 0 and stats["sheltered_iterations"] == stats["measuring_steps"] == 0
    assert 0 < stats["probe_ms"] <= stats["overhead_ms"]


def test_mimose_measures_then_plans_each_input_size_within_the_budget(tmp_path):
    lines, summary, run_dir = _train_tight(tmp_path, "mimose", "planner.mimose.sheltered_steps=3",
                                           "planner.mimose.estimate=sheltered")
    assert [line["phase"] for line in lines[:3]] == ["sheltered"] * 3
    assert all(line["plan"] == ["recompute"] * 4 for line in lines[:3])  # measured, every block checkpointed
    responsive = [line for line in lines if line["phase"] == "responsive"]
    # A plan per input size: the longest batches checkpoint blocks, shorter ones none; the
    # measured peak never exceeds the predicted one.
    assert any(checkpointed(line["plan"]) for line in responsive)
    assert any(not checkpointed(line["plan"]) for line in responsive)
    assert all(line["memory/peak_bytes"] <= line["predicted_peak_bytes"] for line in responsive)
    assert summary["planner"]["phase"] == "responsive" and summary["planner"]["underpredictions"] == 0
    state = json.loads((run_dir / "estimator.json").read_text())
    assert state["counters"]["sheltered_iterations"] == 3 and state["estimator"]["fitted"] is not None


@pytest.mark.parametrize("meter", ["simulated", "allocator"])
def test_the_recipes_meter_counts_the_run_and_mimose_plans_within_it(tmp_path, meter, monkeypatch):
    """``meter: allocator`` counts the run at the allocator; the same plans and peaks as the
    dispatch meter's but for kernels' scratch, which Mimose's prediction margin absorbs."""
    if meter == "allocator":
        require_allocator()
    built = []
    monkeypatch.setattr(step, "build_meter", lambda *args: built.append(build_meter(*args)) or built[-1])
    lines, summary, _ = _train_tight(tmp_path, "mimose", f"meter={meter}")
    assert [m.kind for m in built] == [meter]
    assert all(line["memory/peak_bytes"] <= line["predicted_peak_bytes"] for line in lines)
    assert summary["planner"]["underpredictions"] == 0


def test_a_cpu_meter_asked_for_on_cuda_is_ignored_with_a_warning(quick_recipe):
    recipe = quick_recipe("meter=allocator")
    assert step.run_meter(recipe, torch.device("cpu")) == "allocator"
    with pytest.warns(UserWarning, match="^meter: allocator is ignored on cuda: .*; set meter: auto$"):
        assert step.run_meter(recipe, torch.device("cuda")) == "auto"


def test_dtr_evicts_blocks_to_stay_within_the_budget(tmp_path):
    lines, summary, run_dir = _train_tight(tmp_path, "dtr")
    evicting = [line for line in lines if checkpointed(line["plan"])]  # dtr's plan: the blocks it evicted
    assert evicting and all(line["recompute_ms"] > 0 for line in evicting)
    assert summary["planner"]["evictions"] >= sum(len(checkpointed(line["plan"])) for line in evicting)
    assert summary["planner"]["recomputations"] > 0
    assert not (run_dir / "estimator.json").exists()


def test_a_loss_that_is_not_finite_ends_the_run_as_diverged(quick_recipe):
    from rich.console import Console

    from mimose_cli.runs.report import render

    result = _run(quick_recipe("training.lr=1e30", "training.max_steps=4"))
    summary, records = load_run(result.run_dir)
    step = records[-1].step
    assert summary["status"] == "diverged" == result.summary["status"] and summary["diverged_step"] == step
    assert all(r.loss == r.loss for r in records[:-1]) and records[-1].loss != records[-1].loss  # NaN last
    assert step < 3 and f"at step {step}" in summary["error"] and "training.lr" in summary["error"]
    console = Console(record=True, width=200)
    render(result.run_dir, console)
    text = console.export_text()
    assert "diverged" in text and "lower training.lr" in text


def test_cpu_threads_sets_torchs_intra_op_threads_on_the_cpu(quick_recipe):
    from mimose_cli.launcher.models import model_config
    from mimose_cli.launcher.train import build_trainer

    before = torch.get_num_threads()
    try:
        recipe = quick_recipe("training.cpu_threads=2")
        trainer = build_trainer(recipe, model_config(recipe), total_steps=1)
        trainer.planner.close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_view_says_each_setup_phase_and_the_budget_as_written(tmp_path):
    import io

    from rich.console import Console

    from mimose_cli.launcher.models import build_model

    out = io.StringIO()
    recipe = load_recipe(QUICKSTART, TINY + [f"out_dir={tmp_path}", "budget=8MB", "planner.mimose.sheltered_steps=2"])
    result = run_training(recipe, view="plain", console=Console(file=out, width=200))
    lines = out.getvalue().splitlines()
    setup = [line.split("] ", 1)[1] for line in lines if line.startswith("[")]
    assert [line.split(":")[0] for line in setup] == ["data ready", "device", "model built", "pre-flight", "mimose"]
    assert "memory estimate from 2 probe steps" in setup[-1]
    assert "32 examples" in setup[0] and "8 steps" in setup[0]
    assert "budget 8MB (7.63 MiB)" in setup[1]
    parameters = sum(p.numel() for p in build_model(recipe).parameters())
    assert f"{parameters / 1e6:.2f} M parameters" in setup[2]
    assert not any("sheltered phase" in line for line in lines)  # planned from the first step
    assert "8MB (7.63 MiB)" in out.getvalue().split("summary")[1]  # the summary's budget row
    assert result.summary["budget"] == "8MB"



def test_cuda_runs_get_expandable_segments_unless_the_user_set_the_allocator(monkeypatch):
    """Varying shapes fragment the caching allocator's fixed segments under a budget cap (an H200
    run spent 300-400 ms per step freeing its cache): the launcher sets expandable segments before
    CUDA starts, and leaves a user's own allocator setting alone."""
    for name in step.ALLOCATOR_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    step.expandable_segments()
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    step.expandable_segments()
    assert "PYTORCH_ALLOC_CONF" not in os.environ
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
