"""Stopping a run cleanly on SIGTERM (``timeout``, SLURM, Kubernetes) or Ctrl-C.

A signal only asks the training loop to stop at the next optimizer-step boundary, where the
model, optimizer, data position and planner agree, so the checkpoint written then resumes
exactly. A second Ctrl-C while waiting for that boundary raises ``KeyboardInterrupt`` at once,
as Python does by default; that run keeps its previous checkpoint.
"""

import os
import signal
import threading

EXIT_CODES = {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}
"""The exit status a shell gives a process ended by that signal (143, 130)."""


class StopRequest:
    """Context manager installing SIGTERM and SIGINT handlers that set ``signal_name``; the
    previous handlers are put back on exit. Off the main thread (where Python cannot install
    handlers) it installs nothing and a signal keeps its default effect."""

    def __init__(self, announce: bool = True):
        self.signal_name: str | None = None
        self.announce = announce
        """Whether to say on stderr that the run will stop (not on torchrun's ranks other than 0)."""
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested and name == "SIGINT":
            raise KeyboardInterrupt
        if not self.requested:
            self.signal_name = name
            if self.announce:
                # A raw write: printing through Python's buffered streams from a handler can
                # re-enter a print the loop was in the middle of.
                again = " (Ctrl-C again to stop now)" if name == "SIGINT" else ""
                os.write(2, f"{name}: stopping after this step and writing a checkpoint{again}\n".encode())

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
