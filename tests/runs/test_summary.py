from mimose_cli.runs.records import StepRecord
from mimose_cli.runs.summary import summarize


def _records(iter_ms, plan=("recompute", "keep"), **fields):
    return [StepRecord(step=i, loss=1.0, iter_ms=ms, peak_bytes=100 + i, plan=list(plan), num_blocks=2, **fields)
            for i, ms in enumerate(iter_ms)]


def test_iteration_percentiles_are_nearest_rank_values():
    ten = summarize(_records([float(ms) for ms in range(10, 0, -1)]), status="completed", budget_bytes=None)
    # Ranks 0.5 * 9 = 4.5 and 0.95 * 9 = 8.55 round (half to even) to 4 and 9: values, not interpolations.
    assert (ten["p50_iter_ms"], ten["p95_iter_ms"]) == (5.0, 10.0)
    eleven = summarize(_records([float(ms) for ms in range(1, 12)]), status="completed", budget_bytes=None)
    assert (eleven["p50_iter_ms"], eleven["p95_iter_ms"]) == (6.0, 11.0)
    assert summarize([], status="oom", budget_bytes=None)["p50_iter_ms"] is None


def test_excluded_time_and_out_of_memory_steps_are_not_training_time():
    records = _records([10.0, 20.0], excluded_ms=4.0) + [StepRecord(step=2, oom=True, retries=2, peak_bytes=999)]
    summary = summarize(records, status="oom", budget_bytes=150)
    assert summary["train_time_s"] == 0.022 and summary["mean_iter_ms"] == 11.0
    assert (summary["steps"], summary["oom_steps"], summary["retries"], summary["retried_steps"]) == (2, 1, 2, 1)
    assert summary["peak_bytes"] == 101 and summary["over_budget_steps"] == 0


def test_the_report_shows_the_finer_choices_a_run_made_and_only_then():
    """Selective and offloaded blocks are counted apart from the checkpointed in the summary and
    the per-length table; a run that made none shows neither."""
    from rich.console import Console

    from mimose_cli.runs.report import length_table
    from mimose_cli.runs.summary import summary_tables

    def rendered(records) -> str:
        console = Console(width=200, record=True)
        summary = summarize(records, status="completed", budget_bytes=None)
        for table in [*summary_tables(summary), length_table(records)]:
            console.print(table)
        return console.export_text()

    finer = _records([10.0, 20.0], input_size=[4, 16], plan=("selective", "offload"))
    text = rendered(finer)
    assert "1.00 of 2 (1.00 selective, 1.00 offloaded)" in text
    assert "mean blocks sel" in text and "mean blocks off" in text
    plain = rendered(_records([10.0], input_size=[4, 16]))
    assert "1.00 of 2" in plain and "selective" not in plain and "mean blocks off" not in plain
    partial = rendered(_records([10.0, 20.0], input_size=[4, 16], plan=("partial2", "keep")))
    assert "1.00 of 2 (1.00 partially)" in partial and "mean blocks part" in partial
    assert "partially" not in plain and "mean blocks part" not in plain


def test_the_planner_table_leaves_out_empty_figures_and_keeps_zeros():
    """A planner's figures with nothing in them (None, {}, []) are left out of the printed table
    (summary.json keeps them); a count of 0 is a figure and stays."""
    from rich.console import Console

    from mimose_cli.runs.summary import summary_tables

    summary = summarize(_records([10.0], input_size=[4, 16]), status="completed", budget_bytes=None)
    summary["planner"] = {"planner": "mimose", "underpredictions": 0, "recovery_margins": {}, "hit_rate": None,
                          "probe_skipped": [], "misses": 3}
    console = Console(width=200, record=True)
    for table in summary_tables(summary):
        console.print(table)
    text = console.export_text()
    assert "underpredictions" in text and "misses" in text
    assert not any(key in text for key in ("recovery_margins", "hit_rate", "probe_skipped"))
