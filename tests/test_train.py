import json

import pytest

from mimose_cli.report import load_run
from mimose_cli.train import run_training

# Quickstart at these budgets (simulated device): `none` needs more than TIGHT on the long
# batches, `full` fits within it, and ROOMY fits everything.
TIGHT, ROOMY = "60MB", "200MB"


def _run(recipe):
    return run_training(recipe, view="none")


def test_run_directory_is_complete(quick_recipe):
    result = _run(quick_recipe("planner.name=full"))
    files = {p.name for p in result.run_dir.iterdir()}
    assert {"recipe.yaml", "env.json", "metrics.jsonl", "plans.jsonl", "summary.json"} <= files
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6
    record = json.loads(lines[0])
    for key in ("step", "input_shape", "loss", "iter_ms", "memory/peak_bytes", "plan", "planner_ms"):
        assert key in record
    assert record["plan"] == list(range(record["num_blocks"]))
    assert result.summary["status"] == "completed" and result.summary["steps"] == 6


def test_none_runs_out_of_memory_where_full_fits(quick_recipe):
    none = _run(quick_recipe("planner.name=none", f"budget={TIGHT}"))
    full = _run(quick_recipe("planner.name=full", f"budget={TIGHT}"))
    roomy = _run(quick_recipe("planner.name=none", f"budget={ROOMY}"))
    assert none.summary["status"] == "oom" and none.summary["oom_steps"] == 1
    assert json.loads((none.run_dir / "metrics.jsonl").read_text().splitlines()[-1])["oom"]
    assert full.summary["status"] == "completed"
    assert full.summary["peak_bytes"] <= full.summary["budget_bytes"]
    assert roomy.summary["status"] == "completed"


def test_loss_identical_between_none_and_full_with_dropout(quick_recipe):
    none = _run(quick_recipe("planner.name=none", f"budget={ROOMY}"))
    full = _run(quick_recipe("planner.name=full", f"budget={ROOMY}"))
    losses_none = [r["loss"] for r in none.records]
    losses_full = [r["loss"] for r in full.records]
    assert len(losses_none) == 6
    for a, b in zip(losses_none, losses_full):
        assert abs(a - b) <= 1e-6 * abs(a)
    assert full.summary["peak_bytes"] < none.summary["peak_bytes"]


def test_resolved_recipe_reruns_the_same_run(quick_recipe):
    from mimose_cli.recipe import load_recipe

    first = _run(quick_recipe("planner.name=none", f"budget={ROOMY}"))
    again = _run(load_recipe(first.run_dir / "recipe.yaml"))
    assert [r["loss"] for r in first.records] == [r["loss"] for r in again.records]
    assert [r["input_shape"] for r in first.records] == [r["input_shape"] for r in again.records]


def test_report_reads_an_interrupted_run(quick_recipe):
    result = _run(quick_recipe("planner.name=none", f"budget={ROOMY}"))
    (result.run_dir / "summary.json").unlink()
    with open(result.run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "torn')  # a line cut off by the interruption
    summary, records = load_run(result.run_dir)
    assert summary["status"] == "interrupted"
    assert summary["steps"] == 6 and len(records) == 6
    assert summary["budget_bytes"] == 200 * 10**6


def test_cuda_device_without_gpu_is_a_clear_error(quick_recipe):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        _run(quick_recipe(device="cuda"))
