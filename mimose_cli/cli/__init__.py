"""The ``mimose`` command: one module per command, each thin (parse, load, call one function).

Every command runs inside ``user_errors``, the one place where what the library raises for a
user's mistake becomes one line on stderr: ``ValueError`` (a ``RecipeError``, a bad data file,
a corrupt run directory...) exits 2, ``OSError`` (a full disk, a file that cannot be written)
exits 1. ``mimose --debug COMMAND`` shows the traceback instead.
"""

import functools
import warnings

import typer

EXIT_USAGE, EXIT_RUNTIME, EXIT_INTERRUPTED = 2, 1, 130

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fit PyTorch training into a GPU-memory budget by checkpointing just enough blocks per batch.",
)


_options = {"debug": False}


@app.callback()
def options(debug: bool = typer.Option(False, "--debug", help="On an error, show the traceback too.")):
    """Options for every command (before the command's name)."""
    _options["debug"] = debug  # set on every invocation, before the command runs


def fail(message: str, code: int):
    """End the command with ``error: message`` as one line on stderr."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    raise typer.Exit(code)


def user_errors(command):
    """Run ``command`` with the library's errors turned into one line and an exit code."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (ValueError, OSError, KeyboardInterrupt) as err:
            if _options["debug"]:
                raise
            if isinstance(err, KeyboardInterrupt):
                fail("interrupted", EXIT_INTERRUPTED)
            fail(str(err) or type(err).__name__, EXIT_USAGE if isinstance(err, ValueError) else EXIT_RUNTIME)
    return run


def _register() -> None:
    from mimose_cli.cli import compare, report, train

    app.command("train")(user_errors(train.train))
    app.command("compare")(user_errors(compare.compare))
    app.command("report")(user_errors(report.report))


_register()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one readable line on stderr, not Python's file:line dump."""
    typer.echo(f"warning: {message}", err=True)


def main() -> None:
    warnings.showwarning = _show_warning
    app()
