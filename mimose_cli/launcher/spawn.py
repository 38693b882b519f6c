"""``mimose train --nproc-per-node N``: the same command again under torchrun, N processes on this
machine. No torch here: the command stays quick to start and to fail on a bad recipe.

It runs ``python -m mimose_cli.launcher.torchrun --standalone --nproc-per-node N -m mimose_cli train ...``
(torchrun's own ``main``, so no ``torchrun`` script need be on PATH, without its traceback when a
signal stops it; ``--standalone`` picks a free port on this machine) in a session of its own, and
forwards a signal it gets (Ctrl-C, SIGTERM) to torchrun once, which forwards it to every rank; the
ranks stop together after the step (see ``distributed.py``). torchrun reports any failed rank as
exit status 1, so rank 0 leaves its own status in the file ``MIMOSE_EXIT_FILE`` names and that is
passed on: 0, 1, 2, 130 and 143 mean what they mean for one process.

A launcher killed by SIGKILL cannot forward anything: torchrun's agent gets SIGTERM when the
launcher dies (``signals.stop_with_parent``, told the launcher's pid in ``LAUNCHER_PID_ENV``) and
forwards it to the ranks, and each rank gets SIGTERM when the agent dies (``stop_with_agent``), so
the ranks stop after their step with a checkpoint instead of training on their own.
"""

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from mimose_cli.launcher.signals import STOP_SIGNALS, stop_with_parent

EXIT_FILE_ENV = "MIMOSE_EXIT_FILE"
LAUNCHER_PID_ENV = "MIMOSE_LAUNCHER_PID"
"""The pid of ``mimose train --nproc-per-node``, for torchrun's agent to watch."""
AGENT_PID_ENV = "MIMOSE_AGENT_PID"
"""The pid of torchrun's agent as ``mimose_cli.launcher.torchrun`` started it, for the ranks to watch."""
SAID_DIR_ENV = "MIMOSE_SAID_DIR"
"""A folder of the launcher's where the ranks mark the error lines already printed."""
TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
"""Variables torchrun sets in every process it starts."""


def under_torchrun() -> bool:
    """Whether this process was started by torchrun."""
    return any(name in os.environ for name in TORCHRUN_ENV)


def other_rank() -> bool:
    """Whether this process is a torchrun rank other than 0 (which print nothing but errors)."""
    return os.environ.get("RANK", "0") != "0"


def torchrun_command(nproc_per_node: int, args: list) -> list:
    """The command line that runs ``mimose_cli args`` as ``nproc_per_node`` processes here."""
    return [sys.executable, "-m", "mimose_cli.launcher.torchrun", "--standalone",
            f"--nproc-per-node={nproc_per_node}", "-m", "mimose_cli", *args]


def relaunch(nproc_per_node: int, args: list) -> int:
    """Run ``mimose args`` under torchrun with ``nproc_per_node`` processes; returns rank 0's exit
    status (torchrun's when rank 0 left none: it crashed, or never started)."""
    with tempfile.TemporaryDirectory(prefix="mimose-launch-") as tmp:
        exit_file = Path(tmp) / "exit_status"
        # torchrun sets one OpenMP thread per process when none is set, with a four-line warning;
        # we set that default ourselves (training.cpu_threads still sets torch's threads).
        env = {"OMP_NUM_THREADS": "1", **os.environ, EXIT_FILE_ENV: str(exit_file),
               LAUNCHER_PID_ENV: str(os.getpid()), SAID_DIR_ENV: tmp}
        child = subprocess.Popen(torchrun_command(nproc_per_node, args), env=env, start_new_session=True)

        def forward(signum, frame):
            child.send_signal(signum)

        previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
        try:
            code = child.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        text = exit_file.read_text().strip() if exit_file.exists() else ""
        return int(text) if text else code


def first_to_say(line: str) -> bool:
    """Under ``relaunch``: whether no other rank has printed ``line`` yet, and it is now this rank's
    to print. A mistake every rank finds alike (a planner that cannot plan the model, a bad data
    file) is then one line, not one per rank; lines that differ are each printed. The mark is a
    file created exclusively, so two ranks never both take it."""
    folder = os.environ.get(SAID_DIR_ENV)
    if not folder:
        return True
    mark = Path(folder) / ("said-" + hashlib.sha1(line.encode()).hexdigest()[:16])
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # the launcher's folder is gone: say it rather than lose it
        return True
    return True


def stop_with_agent() -> bool:
    """Under torchrun: SIGTERM to this rank when torchrun's agent (its parent) dies, whatever
    killed it; returns whether the watch is set (not outside torchrun, nor off Linux)."""
    if not under_torchrun():
        return False
    return stop_with_parent(int(os.environ.get(AGENT_PID_ENV, os.getppid())))


def end_rank(code: int) -> None:
    """End a rank's process with ``code`` once its work is written, without Python's shutdown:
    a gloo process group outlives ``destroy_process_group`` while FSDP's mesh still holds it,
    and its worker threads can abort the interpreter's finalization ("terminate called without
    an active exception", SIGABRT; about one run in ten here), which torchrun would report as
    the rank's failure."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a stream closed: nothing left to show
            pass
    os._exit(code)


def leave_exit_status(code: int) -> None:
    """Under ``relaunch``: rank 0 writes its exit status where the launcher reads it."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path and not other_rank():
        Path(path).write_text(str(code))
