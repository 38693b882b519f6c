"""mimose report RUN_DIR [--no-plots] [--stats]"""

from pathlib import Path

import typer


def report(run_dir: Path = typer.Argument(..., help="A runs/<id> directory, or a compare directory."),
           no_plots: bool = typer.Option(False, "--no-plots", help="Print the tables only; write no PNGs."),
           stats: bool = typer.Option(False, "--stats", help="Also print every raw counter of the run's planner "
                                                             "(summary.json's planner section), by its name.")):
    """Show a run's summary and per-iteration statistics from its directory alone, and write its
    plots (PNG) into RUN_DIR/plots/."""
    from mimose_cli.runs.report import render

    render(run_dir, plots=not no_plots, stats=stats)
