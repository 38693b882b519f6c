"""A closed terminal (SIGHUP, the commonest way an interactive overnight run dies) stops a run as
SIGTERM does: after the step, with a checkpoint and a summary, exit 129."""

import fcntl
import json
import os
import pty
import select
import subprocess
import sys
import termios
import time

from helpers import QUICK_OVERRIDES, QUICKSTART, ROOT


def _controlling_terminal():
    """In the child: a session of its own whose controlling terminal is the pty on its stdin."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _steps_recorded(out_dir) -> int:
    metrics = list(out_dir.glob("*/metrics.jsonl"))
    return len(metrics[0].read_text().splitlines()) if metrics else 0


def test_closing_the_terminal_stops_after_the_step_with_a_checkpoint(tmp_path):
    master, slave = pty.openpty()
    command = [sys.executable, "-m", "mimose_cli", "train", str(QUICKSTART), *QUICK_OVERRIDES,
               "training.max_steps=400", "training.checkpoint_every=null", f"--out={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    child = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env,
                             preexec_fn=_controlling_terminal)
    os.close(slave)
    deadline = time.monotonic() + 120
    while _steps_recorded(tmp_path) < 3 and child.poll() is None and time.monotonic() < deadline:
        if select.select([master], [], [], 0.1)[0]:  # keep reading the terminal, as a window does
            os.read(master, 65536)
    assert child.poll() is None and _steps_recorded(tmp_path) >= 3
    os.close(master)  # the terminal goes away: the kernel hangs up the session
    code = child.wait(timeout=120)
    run_dir = next(tmp_path.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert code == 129, summary
    assert summary["status"] == "interrupted" and summary.get("signal") == "SIGHUP"
    assert (run_dir / "checkpoint.pt").is_file() and 3 <= summary["checkpoint_step"] < 400
