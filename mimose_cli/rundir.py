"""The run directory: the only thing ``report`` and ``compare`` read.

Every file is written as things happen (metrics flushed per line), so an interrupted run
still leaves a readable directory.
"""

import json
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mimose_cli.recipe import Recipe, save_recipe

if TYPE_CHECKING:
    from mimose_cli.records import StepRecord


def new_run_dir(out_dir, recipe_name: str, planner: str) -> Path:
    """Create ``out_dir/<timestamp>-<recipe>-<planner>[-n]`` and return it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(out_dir) / f"{stamp}-{recipe_name}-{planner}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
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
    """Appends per-iteration metrics and plans; writes summary and JSON side files."""

    def __init__(self, path: Path, recipe: Recipe, env: dict):
        self.path = Path(path)
        save_recipe(recipe, self.path / "recipe.yaml")
        self.write_json("env.json", env)
        self._metrics = open(self.path / "metrics.jsonl", "a", buffering=1)
        self._plans = open(self.path / "plans.jsonl", "a", buffering=1)

    def metric(self, record: "StepRecord") -> None:
        _append_line(self._metrics, record.to_json())

    def plan(self, record: dict) -> None:
        _append_line(self._plans, record)

    def write_json(self, name: str, data) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2, default=str))
        tmp.replace(self.path / name)

    def close(self) -> None:
        self._metrics.close()
        self._plans.close()


def _append_line(file, data) -> None:
    """One JSON line in a single write, so that a line is never torn between two writes."""
    file.write(json.dumps(data) + "\n")
    file.flush()


def read_jsonl(path: Path) -> list:
    """Read a JSON-lines file, ignoring a torn last line left by an interrupted run."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None
