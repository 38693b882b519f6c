"""A compare directory as ``mimose compare`` and ``mimose report`` show it.

A compare directory (written by ``launcher.sweep.run_compare``) holds ``compare.json`` and one run
directory per (budget, planner) under ``runs/<budget>/``; ``render_compare`` turns it into one
table per budget, ``timing_noise`` says how far its timings can be trusted.
"""

from pathlib import Path

from pydantic import TypeAdapter
from rich.table import Table
from typing_extensions import Required, TypedDict

from mimose_cli.files import read_json
from mimose_cli.runs.live import new_console
from mimose_cli.runs.summary import PlannerFigures, hit_rate_text, overhead_text, recompute_text
from mimose_cli.units import format_budget, format_bytes

NOISE = 0.05
"""Timings on a shared machine swing by this much run to run (docs/BENCHMARKS.md)."""


def timing_noise(data: dict) -> tuple[str, bool]:
    """How far a compare's timings can be trusted, and whether more rounds would help: one round
    each cannot tell a difference under ``NOISE`` from noise; with several, the widest spread of
    one planner's times across rounds is the noise floor."""
    repeats = data.get("repeats", 1)
    if repeats == 1:
        return (f"timings are from one round each; differences under {NOISE:.0%} are within the noise "
                "of a shared machine", True)
    medians = f"medians of {_rounds_text(data)}"
    spreads = [(max(times) / min(times) - 1, row["planner"], entry["budget"])
               for entry in data["budgets"] for row in entry["runs"]
               if len(times := [t for t in row.get("train_times_s") or [] if t]) > 1]
    if not spreads:
        return f"timings are {medians}", False
    spread, planner, budget = max(spreads)
    if spread <= NOISE:
        return f"timings are {medians}, each planner's within {spread:.1%} across rounds", False
    return (f"timings are {medians} but noisy: {planner} at {budget} spread {spread:.0%} "
            "across rounds; differences smaller than that are noise", True)


def _rounds_text(data: dict) -> str:
    """How many rounds the rows' medians are of: ``3 rounds``, or where the comparison stopped
    early (a row's ``rounds`` below ``repeats``) ``1 to 3 rounds``."""
    repeats = data.get("repeats", 1)
    fewest = min((row.get("rounds", repeats) for entry in data["budgets"] for row in entry["runs"]),
                 default=repeats)
    return f"{repeats} rounds" if fewest >= repeats else f"{fewest} to {repeats} rounds (stopped early)"


def unfinished(data: dict) -> str | None:
    """Why a compare.json holds fewer runs than it was asked for (None when it is complete; one
    of an earlier release, without ``status``, was written at its end)."""
    status = data.get("status", "completed")
    if status == "completed":
        return None
    at = f"run {data.get('runs_done')} of {data.get('runs_total')}"
    if status == "interrupted":
        return (f"interrupted by {data.get('signal') or 'a signal'} at {at}: the comparison stopped there; "
                "each row has the rounds its planner ran")
    return f"not finished ({status} at {at}): still running, or killed before it could say"


class _RunRow(TypedDict, total=False):
    planner: Required[str]
    status: Required[str]
    steps: Required[int | None]
    normalised_time: float | None
    train_time_s: float | None
    train_times_s: list[float | None]
    peak_bytes: int | None
    oom_steps: int
    mean_checkpointed_blocks: float | None
    mean_selective_blocks: float | None
    mean_offloaded_blocks: float | None
    mean_partial_blocks: float | None
    recompute_ms: float | None
    planning_ms_total: float | None
    hit_rate: float | None
    phase: str | None
    rounds: int
    signal: str | None
    figures: dict


class _BudgetEntry(TypedDict, total=False):
    budget: Required[str]
    budget_bytes: Required[int | None]
    reference: str | None
    runs: Required[list[_RunRow]]


class _CompareFile(TypedDict, total=False):
    budgets: Required[list[_BudgetEntry]]
    repeats: int
    status: str
    signal: str | None
    runs_done: int
    runs_total: int


COMPARE_FILE = TypeAdapter(_CompareFile)
"""What ``render_compare`` reads of a compare.json: these keys, of these types."""


def _figures(row: dict) -> PlannerFigures:
    """The row's planner figures (``summary.planner_figures``); a compare.json of the previous
    release, without them, has its recompute and planning time and hit rate."""
    if row.get("figures"):
        return PlannerFigures(**row["figures"])
    return PlannerFigures(recompute_ms=row.get("recompute_ms"), overhead_ms=row.get("planning_ms_total"),
                          hit_rate=row.get("hit_rate"))


def _blocks(row: dict) -> str:
    """Mean blocks checkpointed per step, and of them selectively, and blocks offloaded, where any were."""
    blocks = row.get("mean_checkpointed_blocks")
    if blocks is None:
        return "-"
    finer = [f"{row[key]:.2f} {label}" for key, label in (("mean_selective_blocks", "sel"),
                                                           ("mean_partial_blocks", "part"),
                                                           ("mean_offloaded_blocks", "off")) if row.get(key)]
    return f"{blocks:.2f}" + (f" ({', '.join(finer)})" if finer else "")


def compare_table(entry: dict, repeats: int = 1) -> Table:
    """One budget's rows as a rich table; a row of fewer rounds than ``repeats`` (an interrupted
    comparison) says how many in its status."""
    reference = entry.get("reference")
    table = Table(title=f"budget {format_budget(entry['budget'], entry['budget_bytes'])}; "
                        f"time relative to {reference or '-'}", title_justify="left")
    for column in ("planner", "status", "time", "train time", "peak memory", "OOM",
                   "blocks", "recompute", "planning overhead", "cache hits"):
        table.add_column(column, justify="left" if column in ("planner", "status") else "right")
    for row in entry["runs"]:
        figures = _figures(row)
        status = row["status"] if row["status"] != "oom" else f"[red]oom[/red] after {row['steps']}"
        if row.get("rounds", repeats) < repeats:
            status += f" ({row['rounds']}/{repeats} rounds)"
        table.add_row(
            row["planner"], status,
            "-" if row.get("normalised_time") is None else f"{row['normalised_time']:.3f}×",
            "-" if row.get("train_time_s") is None else f"{row['train_time_s']:.2f} s",
            format_bytes(row.get("peak_bytes")), str(row.get("oom_steps", 0)),
            _blocks(row),
            recompute_text(figures, compact=True) or "-", overhead_text(figures, compact=True) or "-",
            hit_rate_text(figures) or "-")
    return table


def read_compare(compare_dir) -> dict:
    """``compare_dir/compare.json``, checked for what the views read of it."""
    return read_json(Path(compare_dir) / "compare.json", COMPARE_FILE)


def render_compare(compare_dir, console=None) -> dict:
    """Print one table per budget from ``compare_dir/compare.json`` (``mimose report`` calls
    this when a directory holds one); returns what it read."""
    console = console or new_console()
    data = read_compare(compare_dir)
    repeats = data.get("repeats", 1)
    console.print(f"compare {data.get('recipe')}: {data.get('steps')} steps, seed {data.get('seed')}"
                  + (f", median of {_rounds_text(data)}" if repeats > 1 else "")
                  + "; blocks = mean blocks checkpointed (dtr: evicted) per step")
    for entry in data["budgets"]:
        console.print(compare_table(entry, repeats))
    stopped = unfinished(data)
    if stopped:
        console.print(stopped, highlight=False)
    if any(row.get("phase") == "sheltered" for entry in data["budgets"] for row in entry["runs"]):
        console.print("mimose spent every step of this comparison in its sheltered phase (measuring, every "
                      "block checkpointed): compare more steps than planner.mimose.sheltered_steps to see "
                      "it plan", highlight=False)
    return data
