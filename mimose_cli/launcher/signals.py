"""Stopping a run cleanly on SIGTERM (``timeout``, SLURM, Kubernetes), SIGHUP (a closed terminal,
a dropped ssh session) or Ctrl-C.

A signal only asks the training loop to stop at the next optimizer-step boundary, where the
model, optimizer, data position and planner agree, so the checkpoint written then resumes
exactly. A second Ctrl-C while waiting for that boundary raises ``KeyboardInterrupt`` at once,
as Python does by default; that run keeps its previous checkpoint. After SIGHUP the terminal is
gone: what would have been written to it (the live view) goes to /dev/null, so that a write to the
dead terminal does not end the run before its checkpoint. A process whose parent may die by
SIGKILL (a rank of ``--nproc-per-node``, torchrun's agent) asks for SIGTERM when it does
(``stop_with_parent``), so it stops in the same way instead of running on alone.
"""

import ctypes
import os
import signal
import sys
import threading

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))
EXIT_CODES = {signal.Signals(signum).name: 128 + signum for signum in STOP_SIGNALS}
"""The exit status a shell gives a process ended by that signal (143, 130, 129)."""


class StopRequest:
    """Context manager installing SIGTERM, SIGHUP and SIGINT handlers that set ``signal_name``; the
    previous handlers are put back on exit. Off the main thread (where Python cannot install
    handlers) it installs nothing and a signal keeps its default effect."""

    def __init__(self, announce: bool = True):
        self.signal_name: str | None = None
        self.announce = announce
        """Whether to say on stderr that the run will stop (not on torchrun's ranks other than 0)."""
        self._previous: dict = {}
        self._terminal_fds: list = []  # stdout/stderr that were a terminal when the run began

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGHUP":
            _to_devnull(self._terminal_fds)
        if self.requested and name == "SIGINT":
            raise KeyboardInterrupt
        if not self.requested:
            self.signal_name = name
            if self.announce:
                # A raw write: printing through Python's buffered streams from a handler can
                # re-enter a print the loop was in the middle of.
                again = " (Ctrl-C again to stop now)" if name == "SIGINT" else ""
                try:
                    os.write(2, f"{name}: stopping after this step and writing a checkpoint{again}\n".encode())
                except OSError:  # stderr is gone too: the summary still says why the run stopped
                    pass

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._terminal_fds = [fd for fd in (1, 2) if _is_terminal(fd)]
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def _is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _to_devnull(fds) -> None:
    """Point ``fds`` at /dev/null: their terminal hung up, and writing to it would raise EIO."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)


PR_SET_PDEATHSIG = 1
"""prctl(2): the signal this process gets when the thread that started it ends."""


def stop_with_parent(parent_pid: int) -> bool:
    """Get SIGTERM when the process that started this one (``parent_pid``) dies, even by SIGKILL,
    which it cannot forward: the ranks of a ``--nproc-per-node`` run, whose launcher or torchrun
    agent is killed, stop after their step with a checkpoint instead of training on their own.
    Linux only (``prctl(PR_SET_PDEATHSIG)``); returns whether the watch is set. A parent already
    gone when it is set (it died during this process's start) is told at once."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(error)}")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)
    return True
