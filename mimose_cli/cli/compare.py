"""mimose compare [RECIPE] [--baselines sublinear,dtr,hf-every-n] [--budgets 4GB,6GB] [--steps N] [--repeats N] [--out DIR] [key=value ...]"""

from pathlib import Path
from typing import List, Optional

import typer

from mimose_cli.cli.common import is_override
from mimose_cli.units import SIZE_HELP


def compare(
    recipe: Optional[Path] = typer.Argument(
        None, help="Recipe YAML, e.g. recipes/mc_roberta.yaml (default: recipes/quickstart.yaml)."),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="Recipe overrides key=value, applied to every run."),
    baselines: str = typer.Option(
        "sublinear,dtr,hf-every-n", help="Comma-separated planners run besides mimose, the recipe's own "
                                         "planner, none and oracle; "
                                         "name:value picks a variant: sublinear:sqrt or sublinear:chen, "
                                         "mimose:selective or oracle:selective (finer plans), "
                                         "mimose:offload or oracle:offload; "
                                         "hf-every-n is the largest every_n_layers stride that fits."),
    budgets: Optional[str] = typer.Option(
        None, help=f"Comma-separated budgets (default: the recipe's); two spellings of one size run once. "
                   f"{SIZE_HELP}"),
    steps: Optional[int] = typer.Option(None, help="Steps per run (default: the recipe's)."),
    out: Optional[Path] = typer.Option(None, help="Compare directory (default runs/compare-<time>-<recipe>)."),
    view: str = typer.Option("none", help="Each run's view: none, plain, live (a table) or auto "
                                          "(live on a terminal)."),
    repeats: int = typer.Option(1, help="Runs per planner and budget, order rotated each round; "
                                               "the tables show the median (for a shared or noisy machine)."),
):
    """Run mimose, the baselines, the recipe's planner, none and oracle on the same data at each budget;
    one table per budget. Ctrl-C or SIGTERM stops it after the current run (exit 130 / 143)."""
    from mimose_cli.cli.recipes import DEFAULT_RECIPE
    from mimose_cli.launcher.recipe import RecipeError, load_recipe
    from mimose_cli.launcher.signals import EXIT_CODES
    from mimose_cli.runs.compare import read_compare, timing_noise
    from mimose_cli.runs.live import check_view

    check_view(view, "--view")
    if is_override(recipe):  # overrides alone: of the default recipe
        recipe, overrides = None, [str(recipe), *(overrides or [])]
    if recipe is None:
        recipe = DEFAULT_RECIPE
        typer.echo(f"no recipe given: comparing on the default, {recipe}", err=True)

    resolved = load_recipe(recipe, overrides or [])
    from mimose_cli.launcher.sweep import run_compare  # torch and transformers: after the recipe is checked

    budget_list = [b.strip() for b in budgets.split(",") if b.strip()] if budgets else None
    if not budget_list and resolved.budget is None:  # said here: the library does not know the flag
        raise RecipeError("compare needs a budget: set `budget` in the recipe or pass --budgets")
    compare_dir = run_compare(resolved, baselines=[b for b in baselines.split(",") if b.strip()],
                              budgets=budget_list, steps=steps, out=out, view=view, recipe_name=recipe.stem,
                              repeats=repeats)
    data = read_compare(compare_dir)
    interrupted = data.get("status") == "interrupted"
    note, more = timing_noise(data)
    typer.echo(note + (f"; run with --repeats {max(3, repeats + 2)} for medians over rotated rounds"
                       if more and not interrupted else ""))
    if interrupted:  # what a shell reports for a process that signal ended, as `train` does
        raise typer.Exit(EXIT_CODES.get(data.get("signal"), EXIT_CODES["SIGINT"]))
