"""``mimose report``: a run (or compare) directory rendered from its files alone."""

from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mimose_cli.runs.compare import render_compare, timing_noise
from mimose_cli.runs.live import new_console, step_table
from mimose_cli.runs.rundir import CHECKPOINT, SHARDED_CHECKPOINT, has_checkpoint, load_run
from mimose_cli.runs.summary import raw_planner_table, summary_tables
from mimose_cli.units import format_bytes

LENGTH_BUCKETS = 8


def length_table(records) -> Table:
    """Per-iteration statistics grouped by padded sequence length."""
    done = [r for r in records if not r.oom and r.input_size]
    table = Table(title="per-iteration statistics by sequence length", title_justify="left")
    finer = [(name, kind) for name, kind in (("mean blocks sel", "selective"), ("mean blocks part", "partial"),
                                             ("mean blocks off", "offload"))
             if any(r.blocks(kind) for r in done)]  # the finer choices, where the run made any
    for name in ("length", "steps", "mean ms/iter", "mean peak", "max peak", "mean blocks ckpt", *(n for n, _ in finer)):
        table.add_column(name, justify="right")
    if not done:
        return table
    longest = max(r.input_size[-1] for r in done)
    width = max(1, -(-longest // LENGTH_BUCKETS))
    groups = defaultdict(list)
    for r in done:
        groups[(r.input_size[-1] - 1) // width].append(r)
    for key in sorted(groups):
        rows = groups[key]
        table.add_row(
            f"{key * width + 1}-{(key + 1) * width}", str(len(rows)),
            f"{sum(r.iter_ms for r in rows) / len(rows):.1f}",
            format_bytes(sum(r.peak_bytes for r in rows) / len(rows)),
            format_bytes(max(r.peak_bytes for r in rows)),
            *(f"{sum(r.blocks(kind) for r in rows) / len(rows):.2f}" for kind in ("checkpointed", *(k for _, k in finer))),
        )
    return table


def eval_table(records) -> Table | None:
    """Every evaluation on the validation split; None when the run has none."""
    evaluated = [r for r in records if r.eval_loss is not None]
    if not evaluated:
        return None
    table = Table(title="evaluations on the validation split", title_justify="left")
    for name in ("after step", "loss", "accuracy", "ms", "peak"):
        table.add_column(name, justify="right")
    for r in evaluated:
        accuracy = "-" if r.eval_accuracy is None else f"{r.eval_accuracy:.4f}"
        ms = "-" if r.eval_ms is None else f"{r.eval_ms:.0f}"
        table.add_row(str(r.step), f"{r.eval_loss:.4f}", accuracy, ms, format_bytes(r.eval_peak_bytes))
    return table


def render_run(run_dir, console: Console, stats: bool = False) -> dict:
    """Print a run directory's tables; with ``stats`` also every raw counter of its planner."""
    summary, records = load_run(run_dir)
    console.print(f"run {Path(run_dir).name}")
    for table in summary_tables(summary):
        console.print(table)
    if stats:
        console.print(raw_planner_table(summary))
    console.print(length_table(records))
    evaluations = eval_table(records)
    if evaluations is not None:
        console.print(evaluations)
    console.print(step_table(records[-10:], summary.get("budget_bytes"), "last steps"))
    for line in _outputs(Path(run_dir), summary):
        console.print(line, highlight=False, soft_wrap=True)
    return summary


def _outputs(run_dir: Path, summary: dict) -> list:
    """Where the trained model and the checkpoint are, and how to use them."""
    lines = []
    model_dir = summary.get("model_dir")
    if model_dir and (run_dir / model_dir).is_dir():
        lines.append(f"model: {run_dir / model_dir} (Hugging Face format: from_pretrained)")
    if has_checkpoint(run_dir):
        step = summary.get("checkpoint_step")
        at = f" at step {step}" if step is not None else ""
        how = "--max-steps N to train further" if summary.get("status") == "completed" else "to continue"
        processes = summary.get("world_size") or 1
        launch = f" --nproc-per-node {processes}" if processes > 1 else ""
        where = run_dir / (CHECKPOINT if (run_dir / CHECKPOINT).is_file() else SHARDED_CHECKPOINT)
        lines.append(f"checkpoint{at}: {where} (mimose train --resume {run_dir}{launch} {how})")
    return lines


def render(path, console: Console | None = None, plots: bool = True, stats: bool = False) -> None:
    """Render a run directory, or a compare directory (one holding compare.json); with ``plots``
    also write its PNGs into ``path/plots/`` and print their paths, with ``stats`` a run's raw
    planner counters (summary.json's ``planner`` section) under their own names."""
    console = console or new_console()
    path = Path(path)
    if not path.is_dir():
        what = "a file" if path.exists() else "no such directory"
        raise ValueError(f"{path} is not a run directory ({what}); expected runs/<id> or a compare directory")
    compare = (path / "compare.json").exists()
    if stats and compare:
        raise ValueError(f"--stats prints one run's planner counters; {path} is a compare directory: "
                         f"give one of its runs, {path}/runs/<budget>/<planner>")
    written = None
    if plots:  # first: a reader that stops early still gets them
        from mimose_cli.runs.plots import write_plots  # matplotlib: imported only when plotting

        written = write_plots(path)
    if compare:
        data = render_compare(path, console)
        console.print(timing_noise(data)[0], highlight=False, soft_wrap=True)
    else:
        render_run(path, console, stats)
    if written is not None:
        _print_plots(written, console)


def _print_plots(written, console: Console) -> None:
    for png in written.written:
        console.print(f"plot: {png}", highlight=False, soft_wrap=True)
    for name, reason in written.skipped:
        console.print(f"plot not drawn: {name} ({reason})", highlight=False, soft_wrap=True)
