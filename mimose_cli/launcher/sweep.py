"""``mimose compare``: every planner on the same data order and seed, at each budget.

``run_compare`` writes a compare directory (``runs.compare`` reads and shows it): ``compare.json``
and one run directory per (budget, planner) under ``runs/<budget>/``. A run that goes out of
memory is a result (status "oom"), never a crash of the comparison; a signal (Ctrl-C, SIGTERM)
stops it, and compare.json says so (``status``, ``signal``, each row's ``rounds``).
"""

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from mimose_cli.files import write_json
from mimose_cli.launcher.recipe import Recipe, recipe_from_dict, recipe_to_dict
from mimose_cli.launcher.signals import StopRequest
from mimose_cli.launcher.spawn import under_torchrun
from mimose_cli.launcher.train import run_training
from mimose_cli.planners.registry import PLANNERS
from mimose_cli.runs.compare import render_compare
from mimose_cli.runs.live import check_view, new_console
from mimose_cli.runs.rundir import RunLock, check_out_dir, unique_dir
from mimose_cli.runs.summary import planner_figures


def _variants() -> list:
    """The planners with compare variants (``variant_field`` of their options), each as
    ``name:value`` with the option's values (``sublinear:greedy|sqrt|chen``)."""
    return [f"{name}:{'|'.join(PLANNERS.options(name).variants())}" for name in sorted(PLANNERS)
            if PLANNERS.options(name).variant_field]


def planner_specs(baselines, own: str | None = None) -> list:
    """``["mimose", *baselines, own, "none", "oracle"]`` without repeats, ``own`` being the recipe's
    own planner (a recipe written for dtr compares dtr whatever the baselines); ``name:value`` sets
    the planner's variant option (its options' ``variant_field``: ``sublinear:sqrt``, ``mimose:selective``).
    Unknown planners, and variants of a planner without them, raise ValueError."""
    specs = []
    for spec in ["mimose", *baselines, own or "", "none", "oracle"]:
        spec = spec.strip()
        if not spec or spec in specs:
            continue
        name, colon, variant = spec.partition(":")
        if name not in PLANNERS:
            raise ValueError(f"unknown planner {name!r} among the baselines; choose from "
                             f"{', '.join(sorted(PLANNERS))}")
        if colon and PLANNERS.options(name).variant_field is None:
            raise ValueError(f"baseline {spec!r}: {name} has no variants (those that do: {', '.join(_variants())}); "
                             f"write {name} alone")
        if colon and not variant.strip():
            own = next(v for v in _variants() if v.startswith(f"{name}:"))
            raise ValueError(f"baseline {spec!r} names no variant after the colon; write {name} alone or {own}")
        specs.append(spec)
    return specs


def _at_budget(recipe: Recipe, budget: str) -> Recipe:
    """The recipe at one of the budgets to compare, validated (and its size parsed) as the
    recipe's own ``budget``."""
    return recipe_from_dict(recipe_to_dict(recipe), "budgets to compare", flags={"budget": budget},
                            flags_from="budgets to compare")


def _run_recipe(recipe: Recipe, spec: str, steps) -> Recipe:
    """The recipe for one run: same seed, data and budget, this planner (with its own section of
    the recipe's planner options; ``sublinear:sqrt`` sets that section's ``variant``,
    ``mimose:selective`` Mimose's ``choices``)."""
    name, _, variant = spec.partition(":")
    flags = {"planner.name": name, "training.max_steps": steps}
    if variant:
        flags[f"planner.{name}.{PLANNERS.options(name).variant_field}"] = variant
    return recipe_from_dict(recipe_to_dict(recipe), f"compare {spec}", flags=flags, flags_from=f"compare {spec}")


def _distinct_runs(recipes: dict, console) -> list:
    """The specs of ``recipes`` (spec -> its run's recipe) whose runs differ: a variant that is
    what the recipe sets already (``mimose:block`` where ``planner.mimose.choices`` is block)
    would run the same configuration twice, so it runs once, under the planner's bare name (the
    name ``none``/``oracle`` rows are found by), and this is said."""
    kept: dict = {}  # the run's recipe as JSON -> the spec it runs as
    for spec, recipe in recipes.items():
        text = json.dumps(recipe_to_dict(recipe), sort_keys=True, default=str)
        same = kept.setdefault(text, spec)
        if same == spec:
            continue
        bare, variant = sorted((same, spec), key=lambda s: ":" in s)
        kept[text] = bare
        name, _, value = variant.partition(":")
        console.print(f"compare: {variant} is the same run as {bare} (the recipe sets "
                      f"planner.{name}.{PLANNERS.options(name).variant_field}: {value} already); it runs once, as {bare}")
    return list(kept.values())


def _row(spec: str, summary: dict, run_dir, compare_dir: Path) -> dict:
    stats = summary.get("planner") or {}
    recompute = summary.get("recompute_ms_total", stats.get("recompute_ms"))
    figures = planner_figures(summary)
    return {
        "planner": spec, "status": summary.get("status"), "steps": summary.get("steps"),
        "oom_steps": summary.get("oom_steps", 0), "train_time_s": summary.get("train_time_s"),
        "peak_bytes": summary.get("peak_bytes"), "budget_bytes": summary.get("budget_bytes"),
        "recompute_ms": recompute, "planning_ms_total": summary.get("planning_ms_total"),
        "hit_rate": figures.hit_rate, "error": summary.get("error"),
        "mean_checkpointed_blocks": summary.get("mean_checkpointed_blocks"),
        "mean_selective_blocks": summary.get("mean_selective_blocks"),
        "mean_offloaded_blocks": summary.get("mean_offloaded_blocks"),
        "mean_partial_blocks": summary.get("mean_partial_blocks"),
        "signal": summary.get("signal"),  # what stopped an interrupted run
        "rounds": 1,  # runs made of this planner at this budget (merge_repeats: one per round)
        "phase": stats.get("phase"),  # mimose: still "sheltered" when the run never left that phase
        "figures": asdict(figures),  # the planner's table in words, as numbers
        "run_dir": str(Path(run_dir).relative_to(compare_dir)) if run_dir else None,
    }


def _median(values):
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _median_figures(rounds: list) -> dict:
    """One planner's figures over several rounds: each number the rounds' median (a count stays
    a count: the lower median is one of them), the rest as the first round has them."""
    merged = dict(rounds[0])
    for key, value in rounds[0].items():
        known = [r[key] for r in rounds if _number(r.get(key))]
        if _number(value) and known:
            merged[key] = statistics.median_low(known)
    return merged


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def merge_repeats(rows: list) -> dict:
    """One planner's rows from several rounds as one row: the median time, recompute and
    planning time, the largest peak; "completed" only when every round completed."""
    failed = next((r for r in rows if r["status"] != "completed"), None)
    merged = dict(failed or rows[0])
    merged["train_times_s"] = [r["train_time_s"] for r in rows]
    merged["run_dirs"] = [r["run_dir"] for r in rows]
    merged["rounds"] = len(rows)
    merged["peak_bytes"] = max((r["peak_bytes"] for r in rows if r["peak_bytes"] is not None), default=None)
    merged["oom_steps"] = max(r.get("oom_steps", 0) for r in rows)
    if failed is None:
        for key in ("train_time_s", "recompute_ms", "planning_ms_total", "mean_checkpointed_blocks",
                    "mean_selective_blocks", "mean_offloaded_blocks", "mean_partial_blocks"):
            merged[key] = _median(r.get(key) for r in rows)
        merged["figures"] = _median_figures([r["figures"] for r in rows])
    return merged


def normalise(rows: list) -> str | None:
    """Set each completed row's ``normalised_time`` against ``none``, or ``oracle`` where
    ``none`` did not complete; returns the reference used (None when neither completed)."""
    by_name = {r["planner"]: r for r in rows}
    reference = next((name for name in ("none", "oracle") if name in by_name
                      and by_name[name]["status"] == "completed"
                      and by_name[name]["train_time_s"]), None)
    for row in rows:
        done = row["status"] == "completed" and reference is not None
        row["normalised_time"] = row["train_time_s"] / by_name[reference]["train_time_s"] if done else None
    return reference


def _one_run(run: Recipe, spec: str, compare_dir: Path, view: str) -> dict:
    out_dir = compare_dir / "runs" / run.budget
    try:
        result = run_training(run, out_dir=out_dir, view=view, recipe_name=spec.replace(":", "-"), save=False)
    except torch.OutOfMemoryError as err:  # before the first step (e.g. a planner's prepare)
        summary = {"status": "oom", "steps": 0, "oom_steps": 1, "error": str(err).splitlines()[0],
                   "budget_bytes": run.budget_bytes}
        return _row(spec, summary, None, compare_dir)
    except KeyboardInterrupt:  # Ctrl-C where the run does not catch it (building it, a second Ctrl-C)
        summary = {"status": "interrupted", "signal": "SIGINT", "steps": 0, "budget_bytes": run.budget_bytes}
        return _row(spec, summary, None, compare_dir)
    return _row(spec, result.summary, result.run_dir, compare_dir)


def _claim_compare_dir(out, recipe: Recipe, recipe_name: str, data: dict) -> Path:
    """The compare directory, new: ``out`` when given (missing or empty), else a fresh
    ``<out_dir>/compare-<time>-<recipe>[-n]``. Creating its compare.json exclusively claims it,
    so two compares never write into one directory and no earlier result is overwritten."""
    if out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        compare_dir = unique_dir(check_out_dir(recipe.out_dir) / f"compare-{stamp}-{recipe_name}")
    else:
        compare_dir = Path(out)
        if compare_dir.is_dir() and any(compare_dir.iterdir()):
            raise ValueError(f"compare directory {str(compare_dir)!r} already exists and is not empty; "
                             "choose a new one to keep its results")
        check_out_dir(compare_dir)
    try:
        with open(compare_dir / "compare.json", "x") as file:
            json.dump(data, file, indent=2)
    except FileExistsError:
        raise ValueError(f"compare directory {str(compare_dir)!r} was taken by another compare; "
                         "choose a new one") from None
    return compare_dir


def _distinct_budgets(at_budgets: list, console) -> list:
    """The recipes at ``at_budgets`` whose budgets differ in bytes: ``40MB``, ``40 MB`` and
    ``40000000`` are one budget spelled three ways, which runs once, as first written, and this is said."""
    kept: dict = {}  # budget_bytes -> the recipe at that budget as first written
    for base in at_budgets:
        first = kept.setdefault(base.budget_bytes, base)
        if first is not base:
            console.print(f"compare: budget {base.budget!r} is {first.budget} again ({base.budget_bytes} bytes); "
                          f"it runs once, as {first.budget}", highlight=False)
    return list(kept.values())


def _run_rounds(data: dict, at_budgets: list, recipes: dict, compare_dir: Path, view: str, console,
                stop: StopRequest) -> str | None:
    """Run each of ``data``'s planners ``data["repeats"]`` times at each budget, the order rotated
    every round, writing compare.json after every run; returns the signal that stopped the
    comparison (a run's, or one between runs), None when every run ran."""
    specs, repeats, started = data["planners"], data["repeats"], time.perf_counter()
    for base in at_budgets:
        entry = {"budget": base.budget, "budget_bytes": base.budget_bytes, "reference": None, "runs": []}
        data["budgets"].append(entry)
        done = {spec: [] for spec in specs}
        for round_ in range(repeats):
            for spec in specs[round_ % len(specs):] + specs[:round_ % len(specs)]:
                elapsed = time.perf_counter() - started
                console.print(f"compare [{data['runs_done'] + 1}/{data['runs_total']}, {elapsed:.0f} s]: {spec} "
                              f"at {base.budget}" + (f" (round {round_ + 1}/{repeats})" if repeats > 1 else ""))
                row = _one_run(recipes[base.budget, spec], spec, compare_dir, view)
                done[spec].append(row)
                data["runs_done"] += 1
                entry["runs"] = [merge_repeats(rows) if repeats > 1 else rows[0] for rows in done.values() if rows]
                entry["reference"] = normalise(entry["runs"])
                write_json(compare_dir / "compare.json", data)
                if row["status"] == "interrupted" or stop.requested:  # Ctrl-C or SIGTERM: stop it all
                    return row["signal"] or stop.signal_name or "SIGINT"
    return None


def run_compare(recipe: Recipe, *, baselines=("sublinear", "dtr", "hf-every-n"), budgets=None, steps=None,
                out=None, view: str = "none", console=None, recipe_name: str = "recipe",
                repeats: int = 1) -> Path:
    """Run every planner (mimose, the baselines, the recipe's own, none and oracle) at every
    budget and write ``compare.json``; returns the directory.

    With ``repeats`` > 1 each planner runs that many times per budget, the order rotated every
    round so that a slow stretch of a shared machine does not always hit the same planner; each
    row then reports the median (``train_times_s`` keeps every round's time, ``rounds`` their
    number). A signal (Ctrl-C, SIGTERM) stops the comparison after the run it lands in:
    compare.json's ``status`` is then "interrupted" and ``signal`` names it ("running" while it
    runs, "completed" once every run ran).
    """
    if under_torchrun():  # N copies would race for one compare directory and one machine's timings
        raise ValueError("compare runs its planners one after another in one process; start it without torchrun")
    if recipe.training.parallel == "fsdp":  # before any run: fsdp needs several processes
        raise ValueError("compare runs its planners in one process, and training.parallel=fsdp shards over several; "
                         "set training.parallel=ddp, or run mimose train --nproc-per-node N per planner "
                         "(benchmarks/fsdp_run.py does)")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} is invalid; expected an integer >= 1")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps={steps!r} is invalid; expected an integer >= 1 (or none: the recipe's)")
    check_view(view)
    specs = planner_specs(baselines, recipe.planner.name)
    budgets = list(budgets or ([recipe.budget] if recipe.budget else []))
    if not budgets:
        raise ValueError("compare needs a budget: set `budget` in the recipe or pass budgets=[...]")
    repeated = next((b for n, b in enumerate(budgets) if b in budgets[:n]), None)
    if repeated is not None:
        raise ValueError(f"budget {repeated} is given twice among the budgets to compare; give each once "
                         "(--repeats N runs each budget N times)")
    console = console or new_console()
    # Every budget and every planner's recipe checked before the first run.
    at_budgets = _distinct_budgets([_at_budget(recipe, budget) for budget in budgets], console)
    # Built once, before the first run: a recipe's warnings (a warm-up longer than the run) are
    # said once, not again for every run after a run's own warnings reset Python's registry.
    recipes = {(base.budget, spec): _run_recipe(base, spec, steps) for base in at_budgets for spec in specs}
    specs = _distinct_runs({spec: recipes[at_budgets[0].budget, spec] for spec in specs}, console)
    data = {"recipe": recipe_name, "planners": specs, "steps": steps or recipe.training.max_steps,
            "seed": recipe.seed, "repeats": repeats, "status": "running", "signal": None,
            "runs_done": 0, "runs_total": len(at_budgets) * len(specs) * repeats, "budgets": []}
    compare_dir = _claim_compare_dir(out, recipe, recipe_name, data)
    # Its runs are written by this process alone; a signal between two runs stops it as one in a run does.
    with RunLock(compare_dir), StopRequest(announce=False) as stop:
        stopped = _run_rounds(data, at_budgets, recipes, compare_dir, view, console, stop)
        data["status"], data["signal"] = ("interrupted", stopped) if stopped else ("completed", None)
        write_json(compare_dir / "compare.json", data)
    render_compare(compare_dir, console)
    console.print(f"compare directory: {compare_dir}")
    return compare_dir
