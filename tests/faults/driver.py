"""Runs ``python -m mimose_cli train`` in a subprocess and injects a fault into it (a signal once a
given step is in its metrics.jsonl), or fills the disk under an in-process run (a patched writer).
Shared by tests/faults/ and benchmarks/fault_injection.py (as ``faults.driver``: pytest's pythonpath holds
``tests``)."""

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
# The quickstart recipe cut to 16 small steps, a checkpoint every 3: about 1 s of training on
# an idle CPU. One thread: on 2 shared cores torch's thread pool spins and is ~10x slower.
TINY = ["training.max_steps=16", "training.batch_size=2", "data.num_examples=24", "data.max_length=32",
        "data.num_choices=2", "planner.mimose.sheltered_steps=2", "training.checkpoint_every=3"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TIMEOUT_S = 300


def command(*args) -> list:
    return [sys.executable, "-m", "mimose_cli", "train", *map(str, args), "--view", "plain"]


def train(out: Path, *overrides) -> subprocess.CompletedProcess:
    """An uninterrupted run of the tiny recipe into ``out``."""
    return subprocess.run(command(QUICKSTART, *TINY, *overrides, "--out", out), env=ENV,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def resume(run_dir: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(command("--resume", run_dir, *args), env=ENV, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def run_dir_in(out: Path) -> Path:
    (run_dir,) = [p for p in Path(out).iterdir() if p.is_dir()]
    return run_dir


def last_step(metrics: Path) -> int:
    """The step of the last complete line of a metrics.jsonl (-1 when it has none)."""
    if not metrics.exists():
        return -1
    lines = metrics.read_bytes().split(b"\n")[:-1]  # what follows the last newline may be torn
    return json.loads(lines[-1])["step"] if lines else -1


def interrupt(signum: int, at_step: int, *args, out: Path | None = None, resume_dir: Path | None = None):
    """Start a run of the tiny recipe into ``out`` (or ``--resume resume_dir``), send ``signum``
    once its metrics.jsonl holds step ``at_step`` (beyond what the file held already), and wait
    for it to end; returns (exit status, output, whether the signal was sent before it ended)."""
    args = ("--resume", resume_dir, *args) if resume_dir else (QUICKSTART, *TINY, *args, "--out", out)
    proc = subprocess.Popen(command(*args), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, sent = time.monotonic() + TIMEOUT_S, False
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            run_dir = resume_dir or _new_run_dir(out)
            if run_dir is not None and last_step(run_dir / "metrics.jsonl") >= at_step:
                proc.send_signal(signum)
                sent = True
                break
            time.sleep(0.005)
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, output, sent


def _new_run_dir(out: Path) -> Path | None:
    return next((p for p in out.iterdir() if p.is_dir()), None) if out.exists() else None


def records(run_dir: Path) -> list:
    """(step, micro_step, loss) of every line of a run's metrics.jsonl; a torn line fails."""
    return [(d["step"], d["micro_step"], d["loss"])
            for d in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())]


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def _full_disk() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


@contextlib.contextmanager
def full_disk(where: str, after: int):
    """Fill the disk under an in-process run. ``where="metrics"``: metrics.jsonl takes ``after``
    lines, then half of the next (the worst a write(2) to a full disk does) and fails;
    ``where="checkpoint"``: checkpoint write number ``after`` fails after part of the file."""
    from mimose_cli.launcher import checkpoint
    from mimose_cli.runs.rundir import RunWriter

    calls = []
    if where == "metrics":
        original = RunWriter.metric

        def metric(self, record):
            if len(calls) == after:
                self._metrics.write('{"step": ' + str(record.step) + ', "lo')
                self._metrics.flush()
                raise _full_disk()
            calls.append(record)
            original(self, record)

        patch = mock.patch.object(RunWriter, "metric", metric)
    else:
        original = checkpoint.torch.save

        def save(obj, file):
            calls.append(obj)
            if len(calls) == after:
                file.write(b"PK\x03\x04 partial")
                raise _full_disk()
            original(obj, file)

        patch = mock.patch.object(checkpoint.torch, "save", save)
    with patch:
        yield


SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP, "SIGKILL": signal.SIGKILL}
