"""The ``mimose`` console script. Importing the CLI (typer, rich, click) takes about a second, and
a Ctrl-C landing in it would be an import traceback; until the CLI has loaded, a Ctrl-C ends with
the one line and exit status of a Ctrl-C during a command. Nothing has been done yet, so nothing
is lost by ending at once."""

import os
import signal

EXIT_INTERRUPTED = 130  # as mimose_cli.cli.common's, which is not imported yet


def _interrupted_while_starting(signum, frame) -> None:
    os.write(2, b"error: interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def main() -> None:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
    from mimose_cli.cli import main as run

    signal.signal(signal.SIGINT, signal.default_int_handler)  # the commands handle their own Ctrl-C
    run()
