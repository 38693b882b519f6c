"""The run directory: the only thing ``report`` and ``compare`` read.

Every file is written as things happen (a metrics line in one write call, flushed; JSON files
replaced atomically), so an interrupted, killed or disk-full run still leaves a readable
directory, and readers name the file and the key when one is not what a run writes.
"""

import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import TypeAdapter, ValidationError

from mimose_cli.recipe import Recipe, save_recipe

if TYPE_CHECKING:
    from mimose_cli.records import StepRecord


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


def check_out_dir(out_dir) -> Path:
    """Create ``out_dir`` if missing and check a directory can be made in it, before anything
    slow is built; raises ValueError naming it otherwise."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"out_dir={str(path)!r} is a file, not a directory; choose a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".mimose-check-", dir=path))
    except OSError as err:
        raise ValueError(f"out_dir={str(path)!r} is not writable ({err.strerror}); "
                         "choose a directory you can write to") from None
    return path


def environment(device) -> dict:
    """Versions and device, for env.json."""
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env


class RunWriter:
    """Appends per-iteration metrics and plans (and, with ``training.tensorboard``, logs each
    step's scalars for TensorBoard); writes summary and JSON side files."""

    def __init__(self, path: Path, recipe: Recipe, env: dict):
        self.path = Path(path)
        save_recipe(recipe, self.path / "recipe.yaml")
        self.write_json("env.json", env)
        self._metrics = open(self.path / "metrics.jsonl", "a", buffering=1)
        self._plans = open(self.path / "plans.jsonl", "a", buffering=1)
        self._tensorboard = None
        if recipe.training.tensorboard:
            from mimose_cli.tblog import TensorBoardLog

            self._tensorboard = TensorBoardLog(self.path, recipe.training.gradient_accumulation_steps)

    def metric(self, record: "StepRecord") -> None:
        _append_line(self._metrics, record.to_json())
        if self._tensorboard is not None:
            self._tensorboard.add(record)

    def plan(self, record: dict) -> None:
        _append_line(self._plans, record)

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


def write_json(path, data) -> None:
    """Write ``data`` as JSON atomically: a temporary file in the same directory, then
    ``os.replace``, so a kill or a full disk leaves the old file or the new one, never half."""
    write_text(path, json.dumps(data, indent=2, default=str))


def file_mode() -> int:
    """The mode a plainly created file gets under the process's umask (``mkstemp`` makes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_text(path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically (see ``write_json``), readable as any file the user
    writes (others on a shared machine read the summary as they read the metrics)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_text(path: Path) -> str | None:
    """A run file's text, None when absent; ValueError naming it when it is a directory or not
    UTF-8 (random bytes, a binary file where a JSON one belongs)."""
    if not path.exists():
        return None
    if not path.is_file():
        raise ValueError(f"{path} is not a file; a run directory holds it as a file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: byte {err.start} is not UTF-8 text; the file is corrupt") from None


def read_jsonl(path: Path) -> list:
    """The objects of a JSON-lines file, [] when absent. A torn last line (a run killed mid-write)
    is skipped; any other line that is not a JSON object raises ValueError naming file and line."""
    text = read_text(path)
    if text is None:
        return []
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: the write was cut short
                continue
            raise ValueError(f"{path} line {number}: not JSON ({err.msg}); the file is corrupt") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} line {number}: expected a JSON object, got {type(data).__name__}")
        records.append(data)
    return records


def read_json(path: Path, schema: TypeAdapter | None = None) -> dict | None:
    """A JSON object file's content, None when absent; ValueError naming the file when it is not
    valid JSON (torn, garbage), not an object, or (given a ``schema``) lacks a key or holds a
    value of the wrong type."""
    text = read_text(path)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}); the file is corrupt") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        if schema is not None:
            schema.validate_python(data, strict=True)
    except ValidationError as err:
        first = err.errors()[0]
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
        if first["type"] == "missing":
            raise ValueError(f"{path}: key {key} is missing; the file is corrupt") from None
        expected = first["msg"].removeprefix("Input should be ")
        raise ValueError(f"{path}: {key}={first['input']!r} is invalid; expected {expected}") from None
    return data
