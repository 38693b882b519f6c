"""Run summaries from per-iteration records, and the tables that show them."""

import statistics
from dataclasses import dataclass

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
    ("out-of-memory steps", "oom_steps", "str"),
    ("budget", "budget_bytes", "budget"),
    ("peak memory", "peak_bytes", "bytes"), ("mean peak memory", "mean_peak_bytes", "bytes"),
    ("steps over budget", "over_budget_steps", "str"),
    ("training time", "train_time_s", "seconds"), ("mean iteration", "mean_iter_ms", "ms"),
    ("p50 / p95 iteration", None, "p50p95"),
    ("mean blocks checkpointed", "mean_checkpointed_blocks", "blocks"),
    ("loss first / last 10 steps", None, "loss"),
    ("peak memory per rank", None, "ranks"),
)


def _summary_value(summary, key, kind):
    if kind == "p50p95":
        return f"{_fmt(summary.get('p50_iter_ms'), 'ms')} / {_fmt(summary.get('p95_iter_ms'), 'ms')}"
    if kind == "loss":
        return f"{_fmt(summary.get('loss_first'), 'float')} / {_fmt(summary.get('loss_last'), 'float')}"
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


@dataclass(frozen=True)
class PlannerFigures:
    """The figures of a planner's work a user acts on, read once off a summary (``planner_figures``);
    each None where it does not apply to this planner or run. JSON-ready: a compare row keeps them."""

    estimate_from: str | None = None
    """probes, sheltered (measured training steps), profile (a static plan's, before training) or
    sizes (the oracle measures each input size)."""
    estimate_steps: int | None = None
    estimate_ms: float | None = None
    estimate_extra_iterations: float | None = None
    estimate_fallback: str | None = None
    """Why the probes could not give the estimate (then a sheltered phase did)."""
    still_sheltered: bool = False
    """The run ended inside its sheltered phase: every step measured, nothing planned yet."""
    cached_plans: int | None = None
    cache_hits: int | None = None
    cache_misses: int | None = None
    hit_rate: float | None = None
    overhead_ms: float | None = None
    overhead_iterations: float | None = None
    iteration_ms: float | None = None
    recompute_ms: float | None = None
    recompute_share: float | None = None
    measured_steps: int | None = None
    untrusted_steps: int | None = None
    untrusted_reasons: dict | None = None
    underpredictions: int | None = None
    max_underprediction_bytes: int | None = None
    unseen_bytes: int | None = None
    """Bytes the device held above the probes' timeline, added to every prediction."""
    retried_steps: int | None = None
    retries: int | None = None
    full_sizes: int | None = None
    """Input sizes run with every block checkpointed after running out of memory."""


def _estimate(stats: dict) -> dict:
    """Where the planner's memory estimate came from and what it cost."""
    source = stats.get("estimate_source")
    if source == "probes":
        return {"estimate_from": "probes", "estimate_steps": stats.get("probe_steps"),
                "estimate_ms": stats.get("probe_ms")}
    if source == "sheltered":
        return {"estimate_from": "sheltered", "estimate_steps": stats.get("sheltered_attempts"),
                "estimate_extra_iterations": stats.get("sheltered_extra_iterations"),
                "estimate_fallback": stats.get("estimate_fallback") or None,
                "still_sheltered": stats.get("phase") == "sheltered"}
    if "measured_sizes" in stats:
        return {"estimate_from": "sizes", "estimate_steps": stats["measured_sizes"],
                "estimate_ms": stats.get("excluded_ms_total")}
    if stats.get("prepare_ms") is not None:
        return {"estimate_from": "profile", "estimate_ms": stats["prepare_ms"]}
    return {}


def _cache(stats: dict) -> dict:
    """The plan cache, for a planner that keeps one."""
    if "hits" not in stats or "misses" not in stats:
        return {}
    lookups = stats["hits"] + stats["misses"]
    return {"cached_plans": stats.get("cached_plans"), "cache_hits": stats["hits"],
            "cache_misses": stats["misses"], "hit_rate": stats["hits"] / lookups if lookups else None}


def _overhead(summary: dict, stats: dict) -> dict:
    """The planner's whole overhead, and as iterations of an ordinary step (Mimose's own count,
    which knows its probes, collector and fits, else the planning time and a static plan's profile)."""
    if "overhead_ms" in stats:
        return {"overhead_ms": stats["overhead_ms"], "overhead_iterations": stats.get("overhead_iterations"),
                "iteration_ms": stats.get("responsive_iteration_ms")}
    planning = summary.get("planning_ms_total", stats.get("planning_ms_total"))
    if planning is None:
        return {}
    overhead = planning + (stats.get("prepare_ms") or 0.0)
    iteration = summary.get("mean_iter_ms")
    return {"overhead_ms": overhead, "overhead_iterations": overhead / iteration if iteration else None,
            "iteration_ms": iteration}


def _trust(stats: dict) -> dict:
    """Steps a planner that predicts measured, or did not trust its prediction at, and why."""
    if "measuring_steps" not in stats:
        return {}
    return {"measured_steps": stats["measuring_steps"], "untrusted_steps": stats.get("untrusted_steps"),
            "untrusted_reasons": stats.get("untrusted_reasons") or None,
            "underpredictions": stats.get("underpredictions"),
            "max_underprediction_bytes": stats.get("max_underprediction_bytes"),
            "unseen_bytes": stats.get("unseen_bytes")}


def planner_figures(summary: dict) -> PlannerFigures:
    """The figures a user acts on of a summary.json's planner (its ``planner`` section) and run."""
    stats = summary.get("planner") or {}
    recompute = summary.get("recompute_ms_total")
    recompute = stats.get("recompute_ms") if recompute is None else recompute  # DTR counts its own
    train_ms = (summary.get("train_time_s") or 0) * 1e3
    return PlannerFigures(
        **_estimate(stats), **_cache(stats), **_overhead(summary, stats), **_trust(stats),
        recompute_ms=recompute or None, recompute_share=recompute / train_ms if recompute and train_ms else None,
        retried_steps=summary.get("retried_steps"), retries=summary.get("retries"),
        full_sizes=stats.get("full_sizes") or None)


def estimate_text(f: PlannerFigures) -> str | None:
    """Where the estimate came from and its cost, in words (None: the planner keeps none)."""
    if f.estimate_from == "probes":
        return f"probes: {f.estimate_steps} steps, {format_duration(f.estimate_ms)}"
    if f.estimate_from == "sheltered":
        cost = ("" if f.estimate_extra_iterations is None
                else f", {f.estimate_extra_iterations:.2f} extra iterations")
        ended = " (the run ended in it)" if f.still_sheltered else ""
        return f"a sheltered phase{ended}: {f.estimate_steps} steps{cost}"
    if f.estimate_from == "sizes":
        return f"measuring each input size: {f.estimate_steps} sizes, {format_duration(f.estimate_ms)}"
    if f.estimate_from == "profile":
        return f"a profile before training: {format_duration(f.estimate_ms)}"
    return None


def overhead_text(f: PlannerFigures, compact: bool = False) -> str | None:
    """The overhead in ms and in iterations of an ordinary step (Mimose's: a responsive one);
    ``compact`` for a table's cell."""
    if f.overhead_ms is None:
        return None
    if f.overhead_iterations is None:
        return format_duration(f.overhead_ms)
    of = " it" if compact else f" iterations of {format_duration(f.iteration_ms)}"
    return f"{format_duration(f.overhead_ms)} ({f.overhead_iterations:.2f}{of})"


def recompute_text(f: PlannerFigures, compact: bool = False) -> str | None:
    """Recompute time and its share of the training time; ``compact`` for a table's cell."""
    if f.recompute_ms is None:
        return None
    of = "" if compact else " of training"
    share = "" if f.recompute_share is None else f" ({f.recompute_share:.1%}{of})"
    return f"{format_duration(f.recompute_ms)}{share}"


def hit_rate_text(f: PlannerFigures) -> str | None:
    """The plan cache's hit rate; None for a planner without one."""
    return None if f.hit_rate is None else f"{f.hit_rate:.0%}"


def planner_rows(summary: dict) -> list[tuple[str, str]]:
    """The planner's table in words, (label, value) rows: what ``mimose train`` prints at its end,
    ``mimose report`` and ``mimose compare`` show; a figure that does not apply is left out
    (every counter stays in summary.json; ``mimose report --stats`` prints them)."""
    f = planner_figures(summary)
    rows = [("estimate from", estimate_text(f)),
            ("probes not used", f.estimate_fallback),
            ("plans cached", None if f.cache_hits is None else str(f.cached_plans)),
            ("plan cache hits / misses", None if f.cache_hits is None else f"{f.cache_hits} / {f.cache_misses}"),
            ("plan cache hit rate", hit_rate_text(f)),
            ("planning overhead", overhead_text(f)),
            ("recompute time", recompute_text(f)),
            ("steps measured / untrusted",
             None if f.measured_steps is None else f"{f.measured_steps} / {f.untrusted_steps}")]
    rows += [(reason, f"{count} steps") for reason, count in (f.untrusted_reasons or {}).items()]
    if f.underpredictions:
        rows.append(("steps over their prediction",
                     f"{f.underpredictions} (at most {format_bytes(f.max_underprediction_bytes)})"))
    if f.unseen_bytes:
        rows.append(("bytes the probes do not see, added to predictions", format_bytes(f.unseen_bytes)))
    rows += compile_rows(summary.get("planner") or {})
    rows += [("retried steps / retries", None if f.retries is None else f"{f.retried_steps} / {f.retries}"),
             ("sizes checkpointed in full after running out of memory",
              None if f.full_sizes is None else str(f.full_sizes))]
    return [(label, value) for label, value in rows if value is not None]


def compile_rows(stats: dict) -> list:
    """Compiled blocks' rows (``planners.compiled``): Dynamo's compile time, and how much of it fell
    in the steps (their iteration times and training time include it; the rest, in the pre-flight
    steps and evaluation, lies outside), and its recompiles."""
    if not stats.get("compiled_blocks"):
        return []
    in_steps = format_duration(stats.get("compile_s_in_steps", 0.0) * 1e3)
    return [("compile time", f"{format_duration(stats['compile_s'] * 1e3)} ({in_steps} of it in training time)"),
            ("compiles / recompiles after warm-up", f"{stats['compiles']} / {stats['recompiles_after_warmup']}")]


def _table(title: str, rows) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for label, value in rows:
        table.add_row(label, value)
    return table


def _raw_value(key: str, value) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and "_ms" in key:
        return format_duration(value) if abs(value) >= 1 or not value else f"{value:.3g} ms"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def raw_planner_table(summary: dict) -> Table:
    """Every counter of summary.json's planner section, under its own name (``report --stats``)."""
    stats = summary.get("planner") or {}
    return _table(f"planner counters: {stats.get('planner', '?')} (summary.json)",
                  ((key, _raw_value(key, value)) for key, value in stats.items() if key != "planner"))


def summary_tables(summary: dict) -> list:
    """The run's summary and its planner's table in words, as rich tables."""
    table = _table("summary", ())
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
    name = (summary.get("planner") or {}).get("planner")
    return [table, _table(f"planner: {name}" if name else "planner", planner_rows(summary))]
