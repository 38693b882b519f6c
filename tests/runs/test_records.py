import json
import re

import pytest
import torch

from mimose_cli.launcher.train import run_training
from mimose_cli.planners.contract import StepInfo
from mimose_cli.planners.recovery import PlanOutOfMemoryError
from mimose_cli.runs.records import StepRecord, completed_step, oom_step, read_records
from mimose_cli.runs.summary import summarize

# Every line has every key, in this order (the keys metrics.jsonl has always had).
KEYS = ["step", "micro_step", "input_shape", "input_size", "loss", "lr", "iter_ms", "memory/peak_bytes",
        "memory/fwd_bwd_peak_bytes", "memory/start_bytes", "memory/activation_bytes", "plan", "num_blocks",
        "planner_ms", "phase", "cache_hit", "predicted_peak_bytes", "reached_bytes", "retries", "excluded_ms",
        "recompute_ms", "oom", "error", "memory/reserved_peak_bytes", "memory/host_peak_bytes", "epoch", "eval_loss",
        "eval_accuracy", "eval_ms", "memory/eval_peak_bytes", "rank", "ranks"]


def _info(**timings) -> StepInfo:
    info = StepInfo(step=3, input_size=(4, 70), plan=("recompute", "keep", "recompute", "keep"), planning_ms=0.25, cache_hit=True,
                    predicted_peak_bytes=31_000_000, retries=1)
    for name, value in timings.items():
        setattr(info, name, value)
    return info


def _completed(**memory) -> StepRecord:
    return completed_step(
        _info(recompute_ms=1.5, excluded_ms=2.0), step=3, micro_step=1, input_shape=torch.Size([4, 70]),
        num_blocks=4, loss=1.25, lr=5e-5, iter_ms=80.5, peak_bytes=30_000_000, fwd_bwd_peak_bytes=29_000_000,
        start_bytes=1_000_000, activation_bytes=20_000_000, **memory)


def test_a_completed_record_round_trips_with_every_key():
    record = _completed()
    data = record.to_json()
    assert list(data) == KEYS and data["error"] is None and data["reached_bytes"] is None
    assert data["memory/peak_bytes"] == 30_000_000 and data["plan"] == ["recompute", "keep", "recompute", "keep"] and data["input_shape"] == [4, 70]
    assert data["recompute_ms"] == 1.5 and data["excluded_ms"] == 2.0 and data["planner_ms"] == 0.25
    assert StepRecord.from_json(json.loads(json.dumps(data))) == record
    assert record.train_ms == 78.5


def test_cuda_and_loop_fields_round_trip():
    record = _completed(reserved_peak_bytes=32_000_000)
    record.host_peak_bytes = 5_000_000
    record.epoch = 2
    record.eval_loss, record.eval_accuracy, record.eval_ms, record.eval_peak_bytes = 0.75, 0.5, 12.5, 9_000_000
    data = record.to_json()
    assert (data["memory/reserved_peak_bytes"], data["memory/host_peak_bytes"], data["epoch"]) == (
        32_000_000, 5_000_000, 2)
    assert (data["eval_loss"], data["eval_accuracy"], data["memory/eval_peak_bytes"]) == (0.75, 0.5, 9_000_000)
    assert StepRecord.from_json(data) == record


def test_an_out_of_memory_record_has_the_same_shape():
    error = PlanOutOfMemoryError("input size (4, 70) ran out of memory\nmore", 40_000_000, 31_000_000,
                                 45_000_000, 2)
    record = oom_step(_info(), error, step=3, micro_step=0, input_shape=[4, 70], num_blocks=4,
                      peak_bytes=39_000_000)
    data = record.to_json()
    assert list(data) == KEYS and data["lr"] is None and data["memory/fwd_bwd_peak_bytes"] is None
    assert data["loss"] is None and data["iter_ms"] == 0.0 and data["oom"] is True
    assert data["error"] == "input size (4, 70) ran out of memory"
    assert (data["predicted_peak_bytes"], data["reached_bytes"], data["retries"]) == (31_000_000, 45_000_000, 2)
    back = StepRecord.from_json(json.loads(json.dumps(data)))
    assert back == record and back.lr is None and back.fwd_bwd_peak_bytes is None and back.recompute_ms is None


def test_an_out_of_memory_record_without_a_plan():
    record = oom_step(None, torch.OutOfMemoryError("out of memory"), step=0, micro_step=0, input_shape=[4, 70],
                      num_blocks=4, peak_bytes=10)
    assert (record.input_size, record.plan, record.phase, record.retries, record.reached_bytes) == \
        (None, [], None, 0, None)
    assert StepRecord.from_json(record.to_json()) == record


def test_old_records_missing_keys_read_with_defaults():
    old = {"step": 2, "input_shape": [4, 70], "loss": 1.5, "iter_ms": 90.0, "memory/peak_bytes": 7,
           "plan": [1], "num_blocks": 4, "a_key_from_a_newer_version": 1}
    record = StepRecord.from_json(old)
    assert (record.micro_step, record.retries, record.oom, record.lr, record.excluded_ms) == (0, 0, False, None, None)
    assert record.peak_bytes == 7 and record.train_ms == 90.0


def test_metrics_of_a_real_run_parse_into_records_of_both_shapes(quick_recipe):
    # `none` at this budget fits the first batches and runs out of memory on a longer one.
    result = run_training(quick_recipe("planner.name=none", "budget=30MB"), view="none")
    assert result.summary["status"] == "oom"
    path = result.run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    records = read_records(path)
    assert records == result.records and len(records) >= 2
    assert [r.oom for r in records] == [False] * (len(records) - 1) + [True]
    assert [list(line) for line in lines] == [KEYS] * len(lines)
    assert lines[-1]["error"] and lines[-1]["lr"] is None and lines[0]["error"] is None
    assert [r.to_json() for r in records] == lines
    again = summarize(records, status="oom", budget_bytes=result.summary["budget_bytes"])
    # What the records cannot tell: the time, the planner's counters, the pre-flight and the run's own facts.
    run_only = ("wall_s", "planner", "preflight", "signal", "checkpoint_step", "resumed_from_steps", "model_dir", "budget",
                "error")
    assert {k: v for k, v in again.items() if k not in run_only} == \
        {k: v for k, v in result.summary.items() if k not in run_only}
    assert result.summary["error"] == records[-1].error


@pytest.mark.parametrize("key, value, said", [
    ("memory/peak_bytes", -5, "memory/peak_bytes=-5 is invalid; expected bytes between 0 and 2**60"),
    ("memory/peak_bytes", 1e300, "memory/peak_bytes=1e+300 is invalid; expected a value of the size a run writes"),
    ("memory/peak_bytes", 2.0**61, "memory/peak_bytes=2305843009213693952 is invalid; expected bytes between 0"),
    ("predicted_peak_bytes", -1, "predicted_peak_bytes=-1 is invalid"),
    ("iter_ms", float("inf"), "iter_ms=inf is invalid; expected milliseconds, finite and >= 0"),
    ("iter_ms", -3.0, "iter_ms=-3.0 is invalid"),
    ("retries", -1, "retries=-1 is invalid; expected a count >= 0"),
])
def test_values_no_run_writes_are_refused_naming_the_file_record_and_key(tmp_path, key, value, said):
    good = {"step": 0, "loss": 1.5, "iter_ms": 90.0, "memory/peak_bytes": 7}
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "step": 1, key: value}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path} record 2: {said}")):
        read_records(path)


def test_a_micro_batch_recorded_twice_is_refused(tmp_path):
    line = json.dumps({"step": 0, "loss": 1.5, "iter_ms": 90.0, "memory/peak_bytes": 7}) + "\n"
    path = tmp_path / "metrics.jsonl"
    path.write_text(line * 2)
    with pytest.raises(ValueError, match="record 2: step 0 micro_step 0 again \\(first as record 1\\)"):
        read_records(path)


@pytest.mark.parametrize("steps, said", [
    ([(0, 0), (1, 0), (3, 0)], "record 3: step 3 micro_step 0 after step 1 micro_step 0"),
    ([(0, 0), (2, 0), (1, 0)], "record 2: step 2 micro_step 0 after step 0 micro_step 0"),
    ([(0, 0), (0, 2)], "record 2: step 0 micro_step 2 after step 0 micro_step 0"),
    ([(0, 0), (1, 1)], "record 2: step 1 micro_step 1 after step 0 micro_step 0"),
])
def test_micro_batches_out_of_order_or_left_out_are_refused(tmp_path, steps, said):
    """A run records each micro-batch in order: a gap or a step out of order is no run's file."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "micro_step": micro, "loss": 1.5, "iter_ms": 90.0,
                                        "memory/peak_bytes": 7}) + "\n" for step, micro in steps))
    with pytest.raises(ValueError, match=re.escape(said)):
        read_records(path)
    path.write_text("".join(json.dumps({"step": step, "micro_step": micro, "loss": 1.5, "iter_ms": 90.0,
                                        "memory/peak_bytes": 7}) + "\n" for step, micro in [(0, 0), (0, 1), (1, 0)]))
    assert [(r.step, r.micro_step) for r in read_records(path)] == [(0, 0), (0, 1), (1, 0)]


@pytest.mark.parametrize("change, said", [
    ({"steps": 5}, "5 steps, but metrics.jsonl records 2; the files are not of one run"),
    ({"budget_bytes": -1}, "budget_bytes -1 is below zero"),
])
def test_a_summary_that_cannot_be_of_its_records_is_refused(tmp_path, change, said):
    from mimose_cli.runs.rundir import load_run

    line = {"step": 0, "loss": 1.5, "iter_ms": 90.0, "memory/peak_bytes": 7}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(line) + "\n" + json.dumps({**line, "step": 1}) + "\n")
    summary = {"status": "completed", "steps": 2, "budget_bytes": 100}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert load_run(tmp_path)[0]["steps"] == 2
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "steps": 3}))  # a torn last line
    assert load_run(tmp_path)[0]["steps"] == 3
    (tmp_path / "summary.json").write_text(json.dumps({**summary, **change}))
    with pytest.raises(ValueError, match=re.escape(said)):
        load_run(tmp_path)


def test_the_previous_releases_four_plan_fields_read_as_one_choice_per_block(tmp_path):
    """A ``metrics.jsonl`` and ``plans.jsonl`` written before a plan was one choice per block
    (``plan`` the indices checkpointed, ``selective``, ``partial`` and ``offload`` beside it) read
    as one choice per block, so that ``mimose report`` reads old run directories."""
    from mimose_cli.runs.records import read_plans

    old = {"step": 0, "micro_step": 0, "input_shape": [2, 8], "input_size": [2, 8], "loss": 1.0,
           "memory/peak_bytes": 100, "plan": [0, 1, 3], "selective": [1], "partial": [[3, "partial2"]],
           "offload": [4], "num_blocks": 6,
           "ranks": [{"rank": 0, "plan": [0, 1, 3]}]}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(old) + "\n")
    (record,) = read_records(tmp_path / "metrics.jsonl")
    assert record.plan == ["recompute", "selective", "keep", "partial2", "offload", "keep"]
    assert (record.blocks("checkpointed"), record.blocks("selective"), record.blocks("offload")) == (3, 1, 1)
    assert record.ranks[0].plan == ["recompute", "recompute", "keep", "recompute", "keep", "keep"]
    (tmp_path / "plans.jsonl").write_text(
        '{"step": 0, "micro_step": 0, "input_size": [2, 8], "plan": [0, 1, 3], "selective": [1], '
        '"partial": [[3, "partial2"]], "offload": [4]}\n{"step": 1, "micro_step": 0, "input_size": [2, 8], "plan": []}\n')
    assert [line["plan"] for line in read_plans(tmp_path / "plans.jsonl", 6)] == [
        ["recompute", "selective", "keep", "partial2", "offload", "keep"], ["keep"] * 6]


def test_an_old_lines_empty_plans_read_as_every_block_kept_or_as_no_plan(tmp_path):
    """In a line of the previous release an empty plan beside the other three fields, or a rank's
    empty plan, kept every block; a step out of memory before any plan (no input size) has none,
    as this release writes it, so that old and new runs compare step for step."""
    old = {"step": 0, "input_shape": [2, 8], "input_size": [2, 8], "loss": 1.0, "memory/peak_bytes": 100,
           "plan": [], "selective": [], "partial": [], "offload": [], "num_blocks": 3,
           "ranks": [{"rank": 0, "plan": [1]}, {"rank": 1, "plan": []}]}
    never = {"step": 1, "input_shape": [2, 8], "input_size": None, "memory/peak_bytes": 100, "oom": True,
             "plan": [], "selective": [], "partial": [], "offload": [], "num_blocks": 3}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(old) + "\n" + json.dumps(never) + "\n")
    planned, unplanned = read_records(tmp_path / "metrics.jsonl")
    assert planned.plan == ["keep"] * 3
    assert [rank.plan for rank in planned.ranks] == [["keep", "recompute", "keep"], ["keep"] * 3]
    assert unplanned.plan == []
