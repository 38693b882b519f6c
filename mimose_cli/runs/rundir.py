"""The run directory: the only thing ``report`` and ``compare`` read.

Every file is written as things happen (a metrics line in one write call, flushed; JSON files
replaced atomically), so an interrupted, killed or disk-full run still leaves a readable
directory, and readers name the file and the key when one is not what a run writes.
"""

import fcntl
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

from mimose_cli.files import read_json, read_text, refuse_dangling_link, write_json, write_text
from mimose_cli.runs.records import StepRecord, plan_line, read_records
from mimose_cli.runs.summary import SUMMARY_FILE, summarize
from mimose_cli.runs.tblog import TensorBoardLog
from mimose_cli.units import parse_size

CHECKPOINT = "checkpoint.pt"
"""The launcher's checkpoint in a run directory (``mimose train --resume`` reads it)."""
SHARDED_CHECKPOINT = "checkpoint"
"""The folder of a ``training.parallel: fsdp`` run's sharded checkpoints (``launcher/sharded.py``)."""
SHARDED_CURRENT = "current"
"""The file in ``SHARDED_CHECKPOINT`` naming its current checkpoint's folder."""


def has_checkpoint(run_dir) -> bool:
    """Whether a run directory holds a checkpoint to resume from (one file, or sharded)."""
    run_dir = Path(run_dir)
    return (run_dir / CHECKPOINT).is_file() or (run_dir / SHARDED_CHECKPOINT / SHARDED_CURRENT).is_file()


def unique_dir(base: Path) -> Path:
    """Create ``base``, or ``base-2``, ``base-3``... when taken, and return it; ``mkdir`` without
    ``exist_ok`` is the claim, so two processes starting in the same second never share one."""
    base.parent.mkdir(parents=True, exist_ok=True)
    path, n = base, 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def new_run_dir(out_dir, recipe_name: str, planner: str) -> Path:
    """Create ``out_dir/<timestamp>-<recipe>-<planner>[-n]`` and return it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return unique_dir(Path(out_dir) / f"{stamp}-{recipe_name}-{planner}")


def check_out_dir(out_dir, flag: str | None = None) -> Path:
    """Create ``out_dir`` if missing and check a directory can be made in it, before anything
    slow is built; raises ValueError naming it (as ``flag``, a command's ``--out``, when given)
    otherwise."""
    path = Path(out_dir)
    given = f"{flag} {str(path)!r}" if flag else f"out_dir={str(path)!r}"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{given} is a file, not a directory; choose a directory")
    refuse_dangling_link(path, given)
    if (path / "metrics.jsonl").exists() or (path / "compare.json").exists():
        raise ValueError(f"{given} is a run (or compare) directory; out_dir names where new run "
                         f"directories go (e.g. {str(path.parent)!r}), and --resume {str(path)} continues that run")
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".mimose-check-", dir=path))
    except OSError as err:
        raise ValueError(f"{given} is not writable ({err.strerror}); "
                         "choose a directory you can write to") from None
    return path


LOCK_FILE = ".mimose.lock"


class RunLock:
    """One writer per run directory: an advisory lock (``flock``) on ``LOCK_FILE`` in it, held while
    ``train``, ``--resume`` or ``compare`` writes there. The kernel releases it when its process
    ends however it ends, so a lock left by a killed run is never stale. A second writer is refused
    before it changes anything, with a ``ValueError`` naming the holder's process id."""

    def __init__(self, directory):
        self.path = Path(directory) / LOCK_FILE
        self._file = None

    def __enter__(self) -> "RunLock":
        file = open(self.path, "a+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            raise ValueError(f"{self.path.parent} is being written by {holder}; wait until it ends, "
                             "or train into another directory") from None
        file.seek(0)
        file.truncate()
        file.write(f"process {os.getpid()} ({' '.join(['mimose', *sys.argv[1:]])[:200]})")
        file.flush()
        self._file = file
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()  # closing the file releases the lock
            self._file = None


class RunWriter:
    """Appends per-iteration metrics and plans (and, with ``training.tensorboard``, logs each
    step's scalars for TensorBoard); writes summary and JSON side files."""

    def __init__(self, path: Path, recipe_yaml: str, env: dict, tensorboard_micro_batches: int | None = None):
        """``recipe_yaml``: the resolved recipe, written as recipe.yaml; with
        ``tensorboard_micro_batches`` (micro-batches per optimizer step) TensorBoard logs too."""
        self.path = Path(path)
        write_text(self.path / "recipe.yaml", recipe_yaml)
        self.write_json("env.json", env)
        self._metrics = open(self.path / "metrics.jsonl", "a", buffering=1)
        self._plans = open(self.path / "plans.jsonl", "a", buffering=1)
        self._tensorboard = None
        if tensorboard_micro_batches is not None:
            self._tensorboard = TensorBoardLog(self.path, tensorboard_micro_batches)

    def metric(self, record: StepRecord) -> None:
        _append_line(self._metrics, record.to_json())
        if self._tensorboard is not None:
            self._tensorboard.add(record)

    def plan(self, record: StepRecord) -> None:
        _append_line(self._plans, plan_line(record))

    def write_json(self, name: str, data) -> None:
        write_json(self.path / name, data)

    def close(self) -> None:
        self._metrics.close()
        self._plans.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _append_line(file, data) -> None:
    """One JSON line in a single write, so that a line is never torn between two writes."""
    file.write(json.dumps(data) + "\n")
    file.flush()


def load_run(run_dir) -> tuple:
    """(summary, records) of a run directory; a run cut off before its summary is summarised
    from metrics.jsonl and marked 'interrupted'. A file that is not what a run writes raises
    ValueError naming it."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise ValueError(f"{run_dir} is not a run directory (no metrics.jsonl) or compare directory "
                         "(no compare.json)")
    records = read_records(run_dir / "metrics.jsonl")
    summary = read_json(run_dir / "summary.json", SUMMARY_FILE)
    if summary is None:
        summary = summarize(records, status="interrupted", budget_bytes=_recipe_budget(run_dir))
    _check_summary(run_dir / "summary.json", summary, records)
    return summary, records


def _check_summary(path: Path, summary: dict, records: list) -> None:
    """ValueError naming ``path`` when its summary cannot be the one of ``records``: another
    number of steps (one more is a torn last line), or a budget below zero."""
    done = sum(1 for record in records if not record.oom)
    # One more than recorded: the last record's line torn by the write that stopped the run.
    if summary.get("steps", done) not in (done, done + 1):
        raise ValueError(f"{path}: {summary['steps']} steps, but metrics.jsonl records {done}; the files "
                         "are not of one run")
    if (summary.get("budget_bytes") or 0) < 0:
        raise ValueError(f"{path}: budget_bytes {summary['budget_bytes']} is below zero; the file is corrupt")


def _recipe_budget(run_dir: Path):
    path = run_dir / "recipe.yaml"
    text = read_text(path)
    try:
        recipe = yaml.safe_load(text) if text else {}
        budget = recipe.get("budget") if isinstance(recipe, dict) else None
        return parse_size(budget) if budget else None
    except (yaml.YAMLError, ValueError):
        raise ValueError(f"{path}: not a recipe with a readable budget; the file is corrupt") from None
