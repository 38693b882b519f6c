"""mimose train RECIPE [--budget SIZE] [--planner NAME] [--device D] [--max-steps N] [--out DIR] [--dry-run]
             [--nproc-per-node N] [key=value ...]
mimose train --resume RUN_DIR [--max-steps N] [--nproc-per-node N]"""

import os
import warnings
from pathlib import Path
from typing import List, Optional

import typer

from mimose_cli.cli.common import fail, is_override
from mimose_cli.cli.common import options as cli_options
from mimose_cli.units import SIZE_HELP

FLAG_NAMES = {"--budget": "budget", "--planner": "planner.name", "--device": "device",
              "--max-steps": "training.max_steps", "--out": "out_dir"}
"""The recipe key each of ``train``'s flags sets; an invalid value is blamed on the flag."""
FLAG_OF = {key: flag for flag, key in FLAG_NAMES.items()}


def train(
    recipe: Optional[Path] = typer.Argument(
        None, help="Recipe YAML, e.g. recipes/quickstart.yaml (none with --resume)."),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="Recipe overrides key=value, e.g. training.max_steps=20 model.size=tiny."),
    budget: Optional[str] = typer.Option(None, help=f"Device memory budget. {SIZE_HELP}"),
    planner: Optional[str] = typer.Option(
        None, help="mimose, none, full, sublinear, dtr, oracle, hf-every-n or offload."),
    device: Optional[str] = typer.Option(None, help="auto, cpu or cuda."),
    max_steps: Optional[int] = typer.Option(None, help="Stop after N steps."),
    out: Optional[Path] = typer.Option(None, help="Directory for run directories (default runs/)."),
    view: str = typer.Option("auto", help="auto (live on a terminal, else plain), live (a table redrawn "
                                          "in place), plain (a line per step) or none."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Measure the budgets the recipe needs at its largest "
                                 "input (every block checkpointed, and none) and exit without training."),
    resume: Optional[Path] = typer.Option(
        None, help="Continue the run directory runs/<id> from its last checkpoint, with its own "
                   "recipe (only training.max_steps may change)."),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", min=1,
        help="Train with N processes on this machine (one per GPU; data parallel, training.batch_size "
             "examples each; training.parallel=fsdp shards the model over them, and --dry-run then measures "
             "every rank): runs this command under torchrun. For several machines run torchrun "
             "yourself (docs/DISTRIBUTED.md)."),
):
    """Train a recipe under a memory budget; writes runs/<id>/."""
    from mimose_cli.launcher.recipe import RecipeError, idle_planner_overrides, load_recipe
    from mimose_cli.launcher.resume import resume_recipe
    from mimose_cli.launcher.spawn import other_rank, relaunch, under_torchrun
    from mimose_cli.runs.live import check_view
    from mimose_cli.runs.rundir import check_out_dir

    check_view(view, "--view")
    given = {"--budget": budget, "--planner": planner, "--device": device, "--max-steps": max_steps,
             "--out": str(out) if out else None}
    flags = {FLAG_NAMES[flag]: value for flag, value in given.items()}
    if resume is not None:
        # With --resume every positional argument is an override.
        if recipe is not None and not is_override(recipe):
            raise RecipeError(f"--resume {resume} continues that run with its own recipe.yaml; "
                              f"leave out {recipe}")
        extra = [str(recipe)] if recipe is not None else []
        resolved = resume_recipe(resume, extra + (overrides or []), flags, FLAG_OF)
    elif recipe is None:
        raise RecipeError("missing RECIPE: give a recipe file, e.g. recipes/quickstart.yaml, or --resume RUN_DIR")
    elif is_override(recipe):
        raise RecipeError(f"missing RECIPE: {str(recipe)!r} is an override (key=value); give the recipe file first, "
                          f"e.g. mimose train recipes/quickstart.yaml {recipe}")
    else:
        resolved = load_recipe(recipe, overrides or [], flags, FLAG_OF)
        for text in [] if other_rank() else idle_planner_overrides(resolved, overrides or []):
            warnings.warn(f"override {text!r} has no effect: this run's planner is {resolved.planner.name}, "
                          f"which reads planner.{resolved.planner.name.replace('-', '_')} only", stacklevel=1)
    if resume is not None and not under_torchrun():
        _check_processes(resume, nproc_per_node or 1, resolved.training.parallel == "fsdp",
                         resolved.training.max_steps is None)
    sharded = resolved.training.parallel == "fsdp"
    if nproc_per_node is not None:  # the recipe is checked above, before any process starts
        if (dry_run and not sharded) or under_torchrun():
            raise RecipeError("--nproc-per-node starts torchrun itself; leave it out "
                              + ("with --dry-run, which measures one device (each rank's under "
                                 "training.parallel=ddp)" if dry_run else "under torchrun"))
        options = {"budget": budget, "planner": planner, "device": device, "max-steps": max_steps, "out": out,
                   "view": view, "resume": resume}
        args = ["--debug"] * cli_options["debug"] + ["train", *([str(recipe)] if recipe else []), *(overrides or [])]
        args += [f"--{name}={value}" for name, value in options.items() if value is not None]
        args += ["--dry-run"] * dry_run
        raise typer.Exit(relaunch(nproc_per_node, args))
    if sharded and not under_torchrun():
        raise RecipeError("training.parallel=fsdp shards the model over several processes: add --nproc-per-node N "
                          "(2 or more), run it under torchrun, or set training.parallel=ddp")
    from mimose_cli.launcher.train import dry_run as measure_only  # after the recipe: its mistakes need no transformers
    from mimose_cli.launcher.train import run_training

    if dry_run and sharded:
        from mimose_cli.launcher.sharded_preflight import sharded_dry_run

        fits = sharded_dry_run(resolved)
        raise typer.Exit(0 if fits or other_rank() else 1)  # rank 0 says it (torchrun would end the others)
    if dry_run:
        from mimose_cli.launcher.preflight import budget_problem

        needs = measure_only(resolved)
        raise typer.Exit(1 if budget_problem(resolved.budget_bytes, needs) else 0)
    if out is not None and resume is None and not other_rank():
        check_out_dir(out, "--out")  # as the run does, but naming the flag
    result = run_training(resolved, view=view, recipe_name=recipe.stem if recipe else "run", resume=resume)
    if view == "none" and not other_rank():
        typer.echo(f"run directory: {result.run_dir}")  # silent, but not lost
    if other_rank():
        # The ranks agreed how the run ended and rank 0 says it: torchrun stops every rank once one
        # exits with an error, which could cut rank 0's summary short; but the rank whose failure
        # ended the run exits 1, so that torchrun ends any rank still waiting on it (failures.py).
        raise typer.Exit(1 if result.summary.get("failed_rank") == int(os.environ["RANK"]) else 0)
    if result.summary["status"] not in ("completed", "interrupted"):  # oom, diverged, failed
        fail(f"{result.summary.get('error') or result.summary['status']} (run directory {result.run_dir})",
             result.exit_code)
    raise typer.Exit(result.exit_code)


def _check_processes(run_dir: Path, processes: int, sharded: bool, by_epochs: bool = False) -> None:
    """A data-parallel run resumes with the number of processes it was trained with (the global
    batch and each rank's state depend on it): said before anything is built, when its
    summary.json says it. A sharded one (``training.parallel: fsdp``) resumes on any number its
    recipe takes (its checkpoint reshards: ``launcher/sharded.py``), unless it trains by epochs
    (``by_epochs``: its steps would hold other numbers of examples)."""
    if sharded and not by_epochs:
        return
    import json

    from mimose_cli.launcher.recipe import RecipeError

    try:
        trained = json.loads((Path(run_dir) / "summary.json").read_text()).get("world_size") or 1
    except (OSError, ValueError, AttributeError):
        return  # no readable summary (a killed run): the checkpoint itself is checked when loaded
    if not isinstance(trained, int) or isinstance(trained, bool) or trained < 1:
        return  # a summary that is not what a run writes: the checkpoint's own count decides
    if trained != processes:
        how = f"--nproc-per-node {trained}" if trained > 1 else "without --nproc-per-node"
        epochs = ", or set training.max_steps (it trains by epochs)" if sharded else ""
        raise RecipeError(f"{run_dir} was trained by {trained} process(es), not {processes}; resume it with "
                          f"mimose train --resume {run_dir} {how}{epochs}")
