import re

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


SNAKE_CASE = re.compile(r"^[a-z]+(_[a-z]+)+$")

MIMOSE_STATS = {"planner": "mimose", "steps": 2, "num_blocks": 2, "planning_ms_total": 5.0, "retries": 0,
                "full_sizes": 0, "sheltered_iterations": 0, "sheltered_attempts": 0, "sheltered_ms": 0.0,
                "hits": 144, "misses": 56, "cached_plans": 56, "measuring_steps": 0, "untrusted_steps": 0,
                "untrusted_reasons": {}, "underpredictions": 0, "max_underprediction_bytes": 0,
                "probe_ms": 150.0, "probe_steps": 2, "probe_twins": 3, "probe_skips_refused": "",
                "estimate_source": "probes", "estimate_fallback": "", "phase": "responsive",
                "collector_ms": 0.0, "scheduler_ms_mean": 0.0, "hit_rate": 0.72,
                "responsive_iteration_ms": 10.0, "overhead_ms": 175.0, "overhead_iterations": 17.5,
                "sheltered_extra_iterations": 0.0, "fit_residual_bytes": 0.0, "selective_in_use": False}


def _summary(stats, recompute_ms=None):
    summary = summarize(_records([10.0, 20.0], input_size=[4, 16]), status="completed", budget_bytes=None,
                        planner_stats=stats)
    summary["recompute_ms_total"] = recompute_ms
    return summary


def _text(summary) -> str:
    from rich.console import Console

    from mimose_cli.runs.summary import summary_tables

    console = Console(width=200, record=True)
    for table in summary_tables(summary):
        console.print(table)
    return console.export_text()


def test_the_planner_table_is_in_words_and_leaves_out_what_does_not_apply():
    """Mimose's probes, plan cache, overhead in ms and iterations, recompute and its share, trust
    and retries, each labelled in words; no sheltered figure without a sheltered phase, no
    untrusted reason without one."""
    from mimose_cli.runs.summary import planner_rows

    rows = dict(planner_rows(_summary(MIMOSE_STATS, recompute_ms=3.0)))
    assert rows == {"estimate from": "probes: 2 steps, 150 ms", "plans cached": "56",
                    "plan cache hits / misses": "144 / 56", "plan cache hit rate": "72%",
                    "planning overhead": "175 ms (17.50 iterations of 10 ms)",
                    "recompute time": "3 ms (10.0% of training)", "steps measured / untrusted": "0 / 0",
                    "retried steps / retries": "0 / 0"}
    text = _text(_summary(MIMOSE_STATS))
    assert "planner: mimose" in text and "sheltered" not in text and "recompute time" not in text
    assert not any(SNAKE_CASE.match(label) for label in rows)
    assert not any(key in text for key in ("probe_twins", "collector_ms", "fit_residual_bytes", "selective_in_use"))
    seen = dict(planner_rows(_summary({**MIMOSE_STATS, "underpredictions": 2, "max_underprediction_bytes": 3 << 20,
                                       "unseen_bytes": 5 << 20})))
    assert seen["steps over their prediction"] == "2 (at most 3.00 MiB)"
    assert seen["bytes the probes do not see, added to predictions"] == "5.00 MiB"


def test_a_sheltered_estimate_says_its_cost_and_why_the_probes_were_not_used():
    from mimose_cli.runs.summary import planner_rows

    stats = {**MIMOSE_STATS, "estimate_source": "sheltered", "estimate_fallback": "the model takes one length",
             "sheltered_attempts": 5, "sheltered_extra_iterations": 1.5, "measuring_steps": 2, "untrusted_steps": 3,
             "untrusted_reasons": {"not trusted, measured: beyond the lengths measured": 3}}
    rows = dict(planner_rows(_summary(stats)))
    assert rows["estimate from"] == "a sheltered phase: 5 steps, 1.50 extra iterations"
    assert rows["probes not used"] == "the model takes one length"
    assert rows["steps measured / untrusted"] == "2 / 3"
    assert rows["not trusted, measured: beyond the lengths measured"] == "3 steps"


def test_a_planner_without_an_estimate_or_a_cache_shows_none_of_mimoses_rows():
    from mimose_cli.runs.summary import planner_rows

    full = {"planner": "full", "steps": 2, "num_blocks": 2, "planning_ms_total": 1.0, "retries": 1, "full_sizes": 0}
    summary = _summary(full, recompute_ms=6.0)
    summary.update(retries=1, retried_steps=1, planning_ms_total=3.0)
    assert dict(planner_rows(summary)) == {"planning overhead": "3 ms (0.20 iterations of 15 ms)",
                                           "recompute time": "6 ms (20.0% of training)",
                                           "retried steps / retries": "1 / 1"}
    sublinear = {**full, "planner": "sublinear", "prepare_ms": 120.0, "static_plan": [0]}
    assert dict(planner_rows(_summary(sublinear)))["estimate from"] == "a profile before training: 120 ms"


def test_the_raw_counters_table_shows_every_counter_by_its_name():
    """``report --stats``: every key of the planner section, empty ones too."""
    from rich.console import Console

    from mimose_cli.runs.summary import raw_planner_table

    console = Console(width=200, record=True)
    console.print(raw_planner_table(_summary(MIMOSE_STATS)))
    text = console.export_text()
    assert all(key in text for key in MIMOSE_STATS if key != "planner")
    assert "scheduler_ms_mean" in text and "untrusted_reasons" in text
