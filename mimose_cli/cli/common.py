"""What every command shares: exit codes, the ``--debug`` switch, and ``user_errors``, the one
place where what the library raises for a user's mistake becomes one line on stderr."""

import functools
import sys

import typer

from mimose_cli.runs.live import silence

EXIT_USAGE, EXIT_RUNTIME, EXIT_INTERRUPTED = 2, 1, 130
EXIT_PIPE_CLOSED = 141
"""What a shell reports for a process ended by SIGPIPE: the reader of our output went away."""

options = {"debug": False}
"""Set by ``mimose --debug`` on every invocation, before the command runs."""


def fail(message: str, code: int):
    """End the command with ``error: message`` as one line on stderr."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    raise typer.Exit(code)


def is_override(argument) -> bool:
    """Whether a RECIPE argument is an override (``key=value``) rather than a recipe file: it
    holds ``=`` and no such file exists."""
    from pathlib import Path

    return argument is not None and "=" in str(argument) and not Path(argument).exists()


def user_errors(command):
    """Run ``command`` with the library's errors turned into one line and an exit code."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except BrokenPipeError:  # the reader stopped (| head): what it read is all it wanted
            silence(sys.stdout)
            raise typer.Exit(EXIT_PIPE_CLOSED)
        except (ValueError, OSError, KeyboardInterrupt) as err:
            if options["debug"]:
                raise
            if isinstance(err, KeyboardInterrupt):
                fail("interrupted", EXIT_INTERRUPTED)
            fail(str(err) or type(err).__name__, EXIT_USAGE if isinstance(err, ValueError) else EXIT_RUNTIME)
    return run
