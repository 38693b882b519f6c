"""Continuing a run directory (``mimose train --resume runs/<id>``): its recipe, and its records
cut back to its checkpoint.

The run keeps its own resolved ``recipe.yaml``; overrides and flags may only change
``RESUMABLE_KEYS`` (``training.max_steps``, to train further; the LR schedule is then stretched
to the new end from the checkpoint on). Records written after the checkpoint are dropped from
``metrics.jsonl`` and ``plans.jsonl``: those steps are trained again, so that every batch
appears exactly once.
"""

import json
import os
import warnings
from pathlib import Path

from mimose_cli.launcher.recipe import RecipeError, load_recipe, recipe_to_dict
from mimose_cli.runs.records import read_records
from mimose_cli.runs.rundir import CHECKPOINT, has_checkpoint

RESUMABLE_KEYS = ("training.max_steps",)
RECORD_FILES = ("metrics.jsonl", "plans.jsonl")


def _flat(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_key(before: dict, after: dict) -> tuple | None:
    """``(dotted key, before, after)`` for the first key but ``RESUMABLE_KEYS`` whose value two
    recipes (``recipe_to_dict``) do not share, or None: what a resumed run may not change."""
    a, b = _flat(before), _flat(after)
    return next(((key, a.get(key), b.get(key)) for key in sorted(set(a) | set(b))
                 if key not in RESUMABLE_KEYS and a.get(key) != b.get(key)), None)


def resume_recipe(run_dir, overrides=(), flags=None, flags_from: str | dict = "the command line"):
    """The recipe of ``run_dir`` with ``overrides`` and ``flags`` applied; RecipeError when it is
    not a run directory with a checkpoint, or when they change anything but ``RESUMABLE_KEYS``."""
    run_dir = Path(run_dir)
    saved = run_dir / "recipe.yaml"
    if not saved.is_file():
        raise RecipeError(f"cannot resume {run_dir}: not a run directory (no recipe.yaml)")
    if (run_dir / CHECKPOINT).is_dir():
        raise RecipeError(f"cannot resume {run_dir}: {CHECKPOINT} is a directory, not a checkpoint file; "
                          "move it away and start the run again")
    if not has_checkpoint(run_dir):
        raise RecipeError(f"cannot resume {run_dir}: no {CHECKPOINT}, the run stopped before its first "
                          "checkpoint (training.checkpoint_every); start it again instead")
    recipe = load_recipe(saved, overrides, flags, flags_from)
    with warnings.catch_warnings():  # the run's own recipe said its warnings when it ran; now ``recipe``'s count
        warnings.simplefilter("ignore")
        trained = load_recipe(saved)
    changed = changed_key(recipe_to_dict(trained), recipe_to_dict(recipe))
    if changed is not None:
        key, before, after = changed
        raise RecipeError(f"cannot resume {run_dir}: {key} is {before!r} in that run, not {after!r}; "
                          f"a resumed run keeps its recipe (only {', '.join(RESUMABLE_KEYS)} may change)")
    return recipe


def cut_records(run_dir, step: int, micro_batches_per_step: int) -> list:
    """Drop the lines of steps ``step`` and later from the run's record files (atomically, each
    line kept byte for byte) and return the ``StepRecord``s kept; ValueError when those are not
    exactly one per micro-batch of the steps before ``step``. The summary of the segment that
    ended goes too: until the resumed run writes its own, ``mimose report`` summarises the
    records."""
    run_dir = Path(run_dir)
    records = [r for r in read_records(run_dir / "metrics.jsonl") if r.step < step]
    expected = [(s, m) for s in range(step) for m in range(micro_batches_per_step)]
    if [(r.step, r.micro_step) for r in records] != expected:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} does not hold one record per micro-batch of "
                         f"the {step} steps before the checkpoint; it was changed since")
    for name in RECORD_FILES:
        if (run_dir / name).exists():
            _keep_lines(run_dir / name, lambda data: data.get("step", step) < step)
    (run_dir / "summary.json").unlink(missing_ok=True)
    return records


def _keep_lines(path: Path, keep) -> None:
    """Rewrite a JSON-lines file with the lines whose object ``keep`` accepts; a torn line goes."""
    lines = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if keep(data):
            lines.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as file:
        file.writelines(lines)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
