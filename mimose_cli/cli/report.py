"""mimose report RUN_DIR"""

from pathlib import Path

import typer


def report(run_dir: Path = typer.Argument(..., help="A runs/<id> directory, or a compare directory.")):
    """Show a run's summary and per-iteration statistics from its directory alone."""
    from mimose_cli.report import render

    render(run_dir)
