"""mimose train RECIPE [--budget SIZE] [--planner NAME] [--device D] [--max-steps N] [--out DIR] [--dry-run] [key=value ...]"""

from pathlib import Path
from typing import List, Optional

import typer

from mimose_cli.units import SIZE_HELP


def train(
    recipe: Path = typer.Argument(..., help="Recipe YAML, e.g. recipes/quickstart.yaml."),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="Recipe overrides key=value, e.g. training.max_steps=20 model.size=tiny."),
    budget: Optional[str] = typer.Option(None, help=f"Device memory budget. {SIZE_HELP}"),
    planner: Optional[str] = typer.Option(None, help="mimose, none, full, sublinear, dtr or oracle."),
    device: Optional[str] = typer.Option(None, help="auto, cpu or cuda."),
    max_steps: Optional[int] = typer.Option(None, help="Stop after N steps."),
    out: Optional[Path] = typer.Option(None, help="Directory for run directories (default runs/)."),
    view: str = typer.Option("auto", help="auto (live table on a terminal), plain or none."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Measure the budgets the recipe needs at its largest "
                                 "input (every block checkpointed, and none) and exit without training."),
):
    """Train a recipe under a memory budget; writes runs/<id>/."""
    from mimose_cli.cli import EXIT_INTERRUPTED, EXIT_RUNTIME, fail
    from mimose_cli.recipe import load_recipe

    flags = {"budget": budget, "planner.name": planner, "device": device,
             "training.max_steps": max_steps, "out_dir": str(out) if out else None}
    resolved = load_recipe(recipe, overrides or [], flags)
    from mimose_cli.train import dry_run as measure_only, run_training  # after the recipe: its mistakes need no transformers

    if dry_run:
        from mimose_cli.preflight import budget_error

        needs = measure_only(resolved)
        raise typer.Exit(1 if budget_error(resolved.budget_bytes, needs) else 0)
    result = run_training(resolved, view=view, recipe_name=recipe.stem)
    status = result.summary["status"]
    if status == "interrupted":
        raise typer.Exit(EXIT_INTERRUPTED)
    if status != "completed":  # oom, diverged: the run directory holds every step until then
        fail(f"{result.summary.get('error') or status} (run directory {result.run_dir})", EXIT_RUNTIME)
