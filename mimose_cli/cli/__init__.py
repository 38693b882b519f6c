"""The ``mimose`` command: one module per command, each thin (parse, load, call one function)."""

import warnings

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fit PyTorch training into a GPU-memory budget by checkpointing just enough blocks per batch.",
)


def _register() -> None:
    from mimose_cli.cli import compare, report, train

    app.command("train")(train.train)
    app.command("compare")(compare.compare)
    app.command("report")(report.report)


_register()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one readable line on stderr, not Python's file:line dump."""
    typer.echo(f"warning: {message}", err=True)


def main() -> None:
    warnings.showwarning = _show_warning
    app()
