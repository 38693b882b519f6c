"""The ``mimose`` command: one module per command, each thin (parse, load, call one function).

Every command runs inside ``user_errors``, the one place where what the library raises for a
user's mistake becomes one line on stderr: ``ValueError`` (a ``RecipeError``, a bad data file,
a corrupt run directory...) exits 2, ``OSError`` (a full disk, a file that cannot be written)
exits 1; a reader that stops early (``| head``) ends the command quietly with 141, as SIGPIPE
would. ``mimose --debug COMMAND`` shows the traceback instead. ``main`` makes click's own usage
errors one line as well, and a Ctrl-C after the command's work (while Python shuts down) the same
one line and 130 as one during it.
"""

import os
import signal
import sys
import warnings

import typer

from mimose_cli.cli import common, compare, recipes, report, train
from mimose_cli.cli.common import EXIT_INTERRUPTED, EXIT_RUNTIME, user_errors

try:  # the exceptions of the click that parses our arguments: typer's own copy since typer 0.2x
    from typer import TyperException as ParserError
except ImportError:
    from click import ClickException as ParserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fit PyTorch training into a GPU-memory budget by checkpointing just enough blocks per batch.",
)


def _version(value: bool) -> None:
    if value:
        from mimose_cli import __version__

        typer.echo(f"mimose {__version__}")
        raise typer.Exit()


@app.callback()
def options(debug: bool = typer.Option(False, "--debug", help="On an error, show the traceback too."),
            version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                         help="Print the version and exit.")):
    """Options for every command (before the command's name)."""
    common.options["debug"] = debug


def _register() -> None:
    app.command("train")(user_errors(train.train))
    app.command("compare")(user_errors(compare.compare))
    app.command("report")(user_errors(report.report))
    app.command("recipes")(user_errors(recipes.recipes))


_register()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one readable line on stderr, not Python's file:line dump."""
    typer.echo(f"warning: {message}", err=True)


def _interrupted_at_exit(signum, frame) -> None:
    """SIGINT once the command is done: Python's shutdown (its atexit callbacks, torch's among them)
    would show a traceback for it; the work is written and the output flushed, so end now."""
    os.write(2, b"error: interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def _flush_and_end_on_interrupt() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a stream closed: nothing left to show
            pass
    signal.signal(signal.SIGINT, _interrupted_at_exit)


def main() -> None:
    """The ``mimose`` entry point; click's own usage errors (an unknown option, a missing or
    malformed argument) are one line too, instead of a usage panel."""
    warnings.showwarning = _show_warning
    try:
        code = app(standalone_mode=False)  # the command's exit code; None when it returned
    except ParserError as err:
        context = getattr(err, "ctx", None)
        if type(err).__name__ == "NoArgsIsHelpError":  # a bare `mimose`: its help
            err.show()
        else:
            hint = f"; see {context.command_path} --help" if context is not None else ""
            typer.echo(f"error: {' '.join(err.format_message().split()).rstrip('.')}{hint}", err=True)
        code = err.exit_code
    except typer.Abort as err:  # click's own: a Ctrl-C that landed in click, after the command or before it
        interrupted = isinstance(err.__cause__, KeyboardInterrupt)
        typer.echo(f"error: {'interrupted' if interrupted else 'aborted'}", err=True)
        code = EXIT_INTERRUPTED if interrupted else EXIT_RUNTIME
    _flush_and_end_on_interrupt()
    from mimose_cli.launcher.spawn import end_rank, leave_exit_status, under_torchrun

    leave_exit_status(code or 0)  # for `mimose train --nproc-per-node`, which runs this under torchrun
    if under_torchrun():  # a rank: its work is written; Python's shutdown could abort it (end_rank)
        end_rank(code or 0)
    sys.exit(code or 0)
