"""Run summaries from per-iteration records, and the tables that show them."""

import statistics

import numpy as np
from pydantic import TypeAdapter
from rich.table import Table
from typing_extensions import Required, TypedDict

from mimose_cli.units import format_budget, format_bytes, format_duration

TAIL = 10


def _percentile(values, q):
    """The ``q``-th percentile as one of the values: the nearest rank, halves to even."""
    return float(np.percentile(values, q, method="nearest")) if values else None


def _mean(values):
    return statistics.fmean(values) if values else None


def _sum_known(values):
    """Sum of the values a planner measured; None when it measured none."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def summarize(records, *, status, budget_bytes, wall_s=None, planner_stats=None) -> dict:
    """Aggregate a run's ``StepRecord``s into summary.json's content."""
    done = [r for r in records if not r.oom]
    iter_ms = [r.train_ms for r in done]
    peaks = [r.peak_bytes for r in done]
    losses = [r.loss for r in done]
    return {
        "status": status,
        "steps": len(done),
        "optimizer_steps": len({r.step for r in done if r.micro_step == 0}),
        "oom_steps": sum(1 for r in records if r.oom),
        # Out-of-memory recovery: attempts that failed and were retried on the same batch.
        "retries": sum(r.retries for r in records),
        "retried_steps": sum(1 for r in records if r.retries),
        "budget_bytes": budget_bytes,
        "train_time_s": sum(iter_ms) / 1e3,
        "wall_s": wall_s,
        "mean_iter_ms": _mean(iter_ms),
        "p50_iter_ms": _percentile(iter_ms, 50),
        "p95_iter_ms": _percentile(iter_ms, 95),
        "peak_bytes": max(peaks) if peaks else None,
        "mean_peak_bytes": _mean(peaks),
        "over_budget_steps": sum(1 for p in peaks if budget_bytes and p > budget_bytes),
        "mean_checkpointed_blocks": _mean([r.blocks("checkpointed") for r in done]),
        "mean_selective_blocks": _mean([r.blocks("selective") for r in done]),
        "mean_offloaded_blocks": _mean([r.blocks("offload") for r in done]),
        "mean_partial_blocks": _mean([r.blocks("partial") for r in done]),
        "host_peak_bytes": max((r.host_peak_bytes for r in done if r.host_peak_bytes is not None), default=None),
        "num_blocks": records[0].num_blocks if records else None,
        "planning_ms_total": sum(r.planner_ms or 0.0 for r in done),
        "recompute_ms_total": _sum_known(r.recompute_ms for r in done),
        "loss_first": _mean(losses[:TAIL]),
        "loss_last": _mean(losses[-TAIL:]),
        **_eval_summary([r for r in done if r.eval_loss is not None]),
        "planner": planner_stats or {},
        "world_size": len(records[0].ranks) if records and records[0].ranks else 1,
        "ranks": rank_totals(records, budget_bytes),
    }


def _eval_summary(evaluated) -> dict:
    """The last evaluation's figures (None without a validation split), every one's time and the
    highest peak."""
    last = evaluated[-1] if evaluated else None
    return {
        "eval_loss": last.eval_loss if last else None,
        "eval_accuracy": last.eval_accuracy if last else None,
        "eval_step": last.step if last else None,
        "eval_time_s": sum(r.eval_ms for r in evaluated) / 1e3 if last else None,
        "eval_peak_bytes": max(r.eval_peak_bytes for r in evaluated) if last else None,
    }


def rank_totals(records, budget_bytes) -> list | None:
    """Per rank of a multi-process run: its highest peak, retries, micro-batches out of memory
    and over the budget (None for one process)."""
    per_rank = [figures for r in records for figures in (r.ranks or [])]
    if not per_rank:
        return None
    totals = []
    for rank in sorted({f.rank for f in per_rank}):
        mine = [f for f in per_rank if f.rank == rank]
        peaks = [f.peak_bytes for f in mine if f.peak_bytes is not None and not f.oom]
        totals.append({"rank": rank, "peak_bytes": max(peaks) if peaks else None,
                       "retries": sum(f.retries for f in mine), "oom_steps": sum(1 for f in mine if f.oom),
                       "over_budget_steps": sum(1 for p in peaks if budget_bytes and p > budget_bytes)})
    return totals


class SummaryFile(TypedDict, total=False):
    """What ``mimose report`` needs of a summary.json: these keys, when present, of these types."""

    status: Required[str]
    steps: int
    oom_steps: int
    retries: int
    retried_steps: int
    budget: str | None
    budget_bytes: int | None
    train_time_s: float | None
    mean_iter_ms: float | None
    p50_iter_ms: float | None
    p95_iter_ms: float | None
    peak_bytes: int | None
    mean_peak_bytes: float | None
    over_budget_steps: int
    mean_checkpointed_blocks: float | None
    num_blocks: int | None
    planning_ms_total: float | None
    recompute_ms_total: float | None
    loss_first: float | None
    loss_last: float | None
    eval_loss: float | None
    eval_accuracy: float | None
    eval_step: int | None
    eval_time_s: float | None
    eval_peak_bytes: int | None
    planner: dict
    error: str | None
    world_size: int
    ranks: list | None


SUMMARY_FILE = TypeAdapter(SummaryFile)


def _fmt(value, kind):
    if value is None:
        return "-"
    if kind == "bytes":
        return format_bytes(value)
    if kind == "ms":
        return format_duration(value)
    if kind == "float":
        return f"{value:.4f}"
    return str(value)


SUMMARY_ROWS = (
    ("status", "status", "str"), ("steps completed", "steps", "str"),
    ("out-of-memory steps", "oom_steps", "str"), ("retried steps / retries", None, "retries"),
    ("budget", "budget_bytes", "budget"),
    ("peak memory", "peak_bytes", "bytes"), ("mean peak memory", "mean_peak_bytes", "bytes"),
    ("steps over budget", "over_budget_steps", "str"),
    ("training time", "train_time_s", "seconds"), ("mean iteration", "mean_iter_ms", "ms"),
    ("p50 / p95 iteration", None, "p50p95"),
    ("mean blocks checkpointed", "mean_checkpointed_blocks", "blocks"),
    ("planning time total", "planning_ms_total", "ms"),
    ("recompute time total", "recompute_ms_total", "ms"),
    ("loss first / last 10 steps", None, "loss"),
    ("peak memory per rank", None, "ranks"),
)


def _summary_value(summary, key, kind):
    if kind == "p50p95":
        return f"{_fmt(summary.get('p50_iter_ms'), 'ms')} / {_fmt(summary.get('p95_iter_ms'), 'ms')}"
    if kind == "loss":
        return f"{_fmt(summary.get('loss_first'), 'float')} / {_fmt(summary.get('loss_last'), 'float')}"
    if kind == "retries":
        return f"{summary.get('retried_steps', 0)} / {summary.get('retries', 0)}"
    if kind == "ranks":
        return " / ".join(_fmt(r.get("peak_bytes"), "bytes") for r in summary["ranks"])
    value = summary.get(key)
    if kind == "budget":
        return format_budget(summary.get("budget"), value)
    if kind == "seconds":
        return "-" if value is None else f"{value:.2f} s"
    if kind == "blocks":
        return "-" if value is None else f"{value:.2f} of {summary.get('num_blocks')}{_finer(summary)}"
    return _fmt(value, kind)


def _finer(summary) -> str:
    """The finer choices among the blocks a run's plans chose, where it made any: " (0.50
    selective, 0.25 partially, 1.00 offloaded)" (the selective and partial are among the
    checkpointed, the offloaded not)."""
    parts = [f"{summary[key]:.2f} {label}" for key, label in (("mean_selective_blocks", "selective"),
                                                             ("mean_partial_blocks", "partially"),
                                                             ("mean_offloaded_blocks", "offloaded"))
             if summary.get(key)]
    return f" ({', '.join(parts)})" if parts else ""


def _planner_value(key: str, value) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and "_ms" in key:
        return format_duration(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _empty(value) -> bool:
    """A planner figure with nothing in it: None, or an empty text, list or mapping (0 is a figure)."""
    return value is None or (isinstance(value, (str, list, tuple, dict)) and not value)


def summary_tables(summary: dict) -> list:
    """The run's summary and its planner's overhead breakdown, as rich tables."""
    table = Table(title="summary", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for label, key, kind in SUMMARY_ROWS:
        if kind != "ranks" or summary.get("ranks"):  # per rank: multi-process runs only
            table.add_row(label, _summary_value(summary, key, kind))
    if summary.get("eval_step") is not None:  # a run with a validation split
        table.add_row(f"eval loss / accuracy (after step {summary['eval_step']})",
                      f"{_fmt(summary.get('eval_loss'), 'float')} / {_fmt(summary.get('eval_accuracy'), 'float')}")
        table.add_row("eval time total / peak memory",
                      f"{summary.get('eval_time_s') or 0:.2f} s / {_fmt(summary.get('eval_peak_bytes'), 'bytes')}")
    if summary.get("error"):  # why a run that did not complete ended
        table.add_row("error", str(summary["error"]))
    tables = [table]
    stats = summary.get("planner") or {}
    if stats:
        figures = {key: value for key, value in stats.items() if key != "planner"}
        shown = {key: value for key, value in figures.items() if not _empty(value)}
        left_out = " (empty figures left out; all in summary.json)" if len(shown) < len(figures) else ""
        planner = Table(title=f"planner: {stats.get('planner', '?')}{left_out}", title_justify="left",
                        show_header=False)
        planner.add_column("what")
        planner.add_column("value", justify="right")
        for key, value in shown.items():
            planner.add_row(key, _planner_value(key, value))
        tables.append(planner)
    return tables
