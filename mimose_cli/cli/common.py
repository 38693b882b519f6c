"""What every command shares: exit codes, the ``--debug`` switch, and ``user_errors``, the one
place where what the library raises for a user's mistake becomes one line on stderr."""

import functools
import re
import sys
from pathlib import Path

import typer

from mimose_cli.launcher.spawn import first_to_say
from mimose_cli.runs.live import silence

EXIT_USAGE, EXIT_RUNTIME, EXIT_INTERRUPTED = 2, 1, 130
EXIT_PIPE_CLOSED = 141
"""What a shell reports for a process ended by SIGPIPE: the reader of our output went away."""

options = {"debug": False}
"""Set by ``mimose --debug`` on every invocation, before the command runs."""


def fail(message: str, code: int):
    """End the command with ``error: message`` as one line on stderr (once for every rank of
    ``--nproc-per-node`` that ends with the same line)."""
    line = f"error: {' '.join(message.split())}"
    if first_to_say(line):
        typer.echo(line, err=True)
    raise typer.Exit(code)


_DOTTED_KEY = re.compile(r"[A-Za-z_]\w*(\.[\w-]+)*")


def is_override(argument) -> bool:
    """Whether a RECIPE argument is an override (``key=value``, the key dotted words) rather than
    a recipe file; a file of that name is a recipe (``recipes/lr=1e-3.yaml`` is a path either
    way: its ``/`` is no key's)."""
    if argument is None:
        return False
    key, equals, _ = str(argument).partition("=")
    if not equals or not _DOTTED_KEY.fullmatch(key.strip()):
        return False
    try:
        return not Path(argument).exists()
    except OSError:  # a name too long for a file: an override's value
        return True


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
