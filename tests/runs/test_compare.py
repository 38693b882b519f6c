"""mimose compare: every planner at every budget, out of memory as a result, compare.json + tables."""

import json
import warnings

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import mimose_cli.launcher.sweep
from mimose_cli.cli import app
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.sweep import normalise, planner_specs
from mimose_cli.runs.compare import render_compare

from helpers import QUICKSTART

# Fake training: time per planner, and which (planner, budget) runs out of memory.
TIMES = {"mimose": 11.0, "sublinear": 14.0, "dtr": 15.0, "hf-every-n": 13.0, "none": 10.0, "oracle": 10.5}


@pytest.fixture
def fake_training(monkeypatch, tmp_path):
    calls = []

    def run_training(recipe, *, out_dir=None, view="auto", console=None, recipe_name="run", save=True):
        calls.append((recipe.planner.name, recipe.budget, recipe.training.max_steps,
                      recipe.planner.keywords, recipe.seed))
        run_dir = out_dir / f"{recipe_name}"
        run_dir.mkdir(parents=True)
        if recipe.planner.name == "sublinear" and recipe.budget == "1MB":
            raise torch.OutOfMemoryError("simulated device out of memory: in prepare")
        oom = recipe.planner.name == "none" and recipe.budget == "1MB"
        choices = recipe.planner.keywords.get("choices")
        summary = {"status": "oom" if oom else "completed", "steps": 2 if oom else 5,
                   "oom_steps": int(oom), "train_time_s": TIMES[recipe.planner.name],
                   "peak_bytes": 900_000, "budget_bytes": 10**6, "planning_ms_total": 1.0,
                   "mean_checkpointed_blocks": 1.5,
                   "mean_selective_blocks": 0.5 if choices in ("selective", "offload") else 0.0,
                   "mean_offloaded_blocks": 0.25 if choices == "offload" else 0.0,
                   "planner": ({"hits": 3, "misses": 3, "cached_plans": 3, "hit_rate": 0.5}
                               if recipe.planner.name == "mimose" else {})}
        return mimose_cli.launcher.train.RunResult(run_dir, summary)

    monkeypatch.setattr(mimose_cli.launcher.sweep, "run_training", run_training)
    return calls


def test_compare_command_runs_every_planner_at_every_budget(fake_training, tmp_path):
    out = tmp_path / "cmp"
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--budgets", "1MB,2MB",
                                      "--steps", "5", "--out", str(out), "seed=3"])
    assert result.exit_code == 0, result.output
    names = [c[0] for c in fake_training]
    assert names == ["mimose", "sublinear", "dtr", "hf-every-n", "none", "oracle"] * 2
    assert {c[2] for c in fake_training} == {5} and {c[4] for c in fake_training} == {3}
    data = json.loads((out / "compare.json").read_text())
    tight, roomy = data["budgets"]
    rows = {r["planner"]: r for r in tight["runs"]}
    assert tight["reference"] == "oracle"  # none ran out of memory at 1MB
    assert rows["none"]["status"] == "oom" and rows["none"]["normalised_time"] is None
    assert rows["sublinear"]["status"] == "oom" and "prepare" in rows["sublinear"]["error"]
    assert rows["mimose"]["normalised_time"] == pytest.approx(11.0 / 10.5)
    assert rows["mimose"]["hit_rate"] == 0.5
    assert roomy["reference"] == "none"
    assert {r["planner"]: r["normalised_time"] for r in roomy["runs"]}["dtr"] == pytest.approx(1.5)
    assert "budget 1MB (976.56 KiB)" in result.output and "oom" in result.output
    assert "timings are from one round each" in result.output and "--repeats 3" in result.output


def test_variants_and_unknown_planners():
    assert planner_specs(["sublinear:sqrt", "dtr", "none"]) == ["mimose", "sublinear:sqrt", "dtr", "none", "oracle"]
    with pytest.raises(ValueError, match="unknown planner 'dtx'"):
        planner_specs(["dtx"])


def test_variant_option_reaches_the_planner(fake_training, tmp_path):
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--baselines",
                                      "sublinear:chen", "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    options = {c[0]: c[3] for c in fake_training}
    assert options["sublinear"] == {"variant": "chen"} and options["none"] == {}
    assert {c[1] for c in fake_training} == {load_recipe(str(QUICKSTART)).budget}


def test_finer_plans_compare_beside_block_level_ones(fake_training, tmp_path):
    """``mimose:selective`` and ``oracle:selective`` run beside the recipe's (block-level) Mimose
    and oracle, each with its ``choices``, in rows of their own."""
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--baselines",
                                      "mimose:selective,mimose:offload,oracle:selective", "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    runs = {(c[0], c[3].get("choices", "block")) for c in fake_training if c[0] in ("mimose", "oracle")}
    assert runs == {("mimose", "block"), ("mimose", "selective"), ("mimose", "offload"), ("oracle", "block"),
                    ("oracle", "selective")}
    rows = json.loads((tmp_path / "c" / "compare.json").read_text())["budgets"][0]["runs"]
    planners = {r["planner"] for r in rows}
    assert {"mimose", "mimose:selective", "mimose:offload", "oracle", "oracle:selective"} <= planners
    blocks = {line.split()[1]: line for line in result.output.splitlines() if line.startswith("│ mimose")}
    assert "1.50 (0.50 sel)" in blocks["mimose:selective"] and "sel)" not in blocks["mimose"]
    assert "1.50 (0.50 sel, 0.25 off)" in blocks["mimose:offload"]
    assert {c[1] for c in fake_training} == {load_recipe(str(QUICKSTART)).budget}


def test_a_variant_the_recipe_already_sets_runs_once(fake_training, tmp_path):
    """``mimose:block`` on a recipe whose Mimose plans by block is the same run as ``mimose``:
    run once and said, while ``oracle:selective`` (other options) still runs beside ``oracle``."""
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--baselines", "mimose:block,oracle:selective",
                                      "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    runs = [(c[0], c[3].get("choices", "block")) for c in fake_training if c[0] in ("mimose", "oracle")]
    assert sorted(runs) == [("mimose", "block"), ("oracle", "block"), ("oracle", "selective")]
    assert "mimose:block is the same run as mimose" in " ".join(result.output.split())
    data = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert "mimose:block" not in data["planners"] and "oracle:selective" in data["planners"]


def test_a_variant_listed_before_the_bare_name_runs_as_the_bare_name(fake_training, tmp_path):
    """``oracle:block`` comes before the ``oracle`` compare adds itself; the one run is the
    ``oracle`` row, which times are normalised to where ``none`` runs out of memory."""
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--baselines", "oracle:block", "--budgets", "1MB",
                                      "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert [c[0] for c in fake_training].count("oracle") == 1
    assert "oracle:block is the same run as oracle" in " ".join(result.output.split())
    budget = json.loads((tmp_path / "c" / "compare.json").read_text())["budgets"][0]
    assert "oracle" in [r["planner"] for r in budget["runs"]] and budget["reference"] == "oracle"


def test_a_recipe_warning_is_said_once_not_per_run(fake_training, monkeypatch, tmp_path):
    """A warm-up longer than the compared steps is one warning, though each run resets Python's
    once-per-place registry (any ``warnings.catch_warnings`` does, as training's do)."""
    inner = mimose_cli.launcher.sweep.run_training

    def run_training(recipe, **kwargs):
        with warnings.catch_warnings():
            return inner(recipe, **kwargs)

    monkeypatch.setattr(mimose_cli.launcher.sweep, "run_training", run_training)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--steps", "2", "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert len(fake_training) == 6
    assert [str(w.message) for w in caught if "warmup_steps" in str(w.message)] == [
        "training.warmup_steps=5 is longer than the run (training.max_steps=2): the learning rate never reaches "
        "training.lr"]


def test_no_reference_when_none_and_oracle_fail():
    rows = [{"planner": "none", "status": "oom", "train_time_s": 1.0},
            {"planner": "oracle", "status": "oom", "train_time_s": 1.0},
            {"planner": "mimose", "status": "completed", "train_time_s": 1.0}]
    assert normalise(rows) is None and rows[2]["normalised_time"] is None


def test_render_reads_the_compare_directory(fake_training, tmp_path):
    out = tmp_path / "cmp"
    CliRunner().invoke(app, ["compare", str(QUICKSTART), "--budgets", "2MB", "--out", str(out)])
    console = Console(record=True, width=160)
    render_compare(out, console)
    text = console.export_text()
    assert "budget 2MB" in text and "1.100×" in text and "50%" in text
    report = CliRunner().invoke(app, ["report", str(out), "--no-plots"])
    assert report.exit_code == 0 and "timings are from one round each" in report.output
    assert "--repeats" not in report.output  # the library names no flag
    stats = CliRunner().invoke(app, ["report", str(out), "--stats"])
    assert stats.exit_code == 2 and "--stats prints one run's planner counters" in stats.output


def test_compare_rows_carry_the_planners_figures_and_read_without_them(fake_training, tmp_path):
    """Each compare row keeps the planner's figures in words' numbers (``planner_figures``): the
    overhead in iterations, the hit rate for the planner with a plan cache only; a compare.json of
    the previous release, without them, still shows its hit rate."""
    out = tmp_path / "cmp"
    CliRunner().invoke(app, ["compare", str(QUICKSTART), "--budgets", "2MB", "--out", str(out)])
    data = json.loads((out / "compare.json").read_text())
    rows = {r["planner"]: r for r in data["budgets"][0]["runs"]}
    assert rows["mimose"]["figures"]["cache_hits"] == 3 and rows["dtr"]["figures"]["hit_rate"] is None

    def rendered() -> list:
        console = Console(record=True, width=200)
        render_compare(out, console)
        return [line for line in console.export_text().splitlines() if line.startswith("│ mimose")]

    (mimose,) = rendered()
    assert "50%" in mimose and "1 ms" in mimose
    for row in data["budgets"][0]["runs"]:
        del row["figures"]
    (out / "compare.json").write_text(json.dumps(data))
    (old,) = rendered()
    assert "50%" in old


def test_repeats_rotate_the_order_and_report_the_median(monkeypatch, tmp_path):
    order, times = [], {"mimose": iter([12.0, 9.0, 11.0]), "none": iter([10.0, 10.0, 30.0])}

    def run_training(recipe, *, out_dir=None, view="auto", console=None, recipe_name="run", save=True):
        name = recipe.planner.name
        order.append(name)
        run_dir = out_dir / f"{recipe_name}-{len(order)}"
        run_dir.mkdir(parents=True)
        oom = name == "oracle" and len(order) > 6  # the oracle fails in the last round only
        summary = {"status": "oom" if oom else "completed", "steps": 5, "oom_steps": int(oom),
                   "train_time_s": next(times[name]) if name in times else 10.5,
                   "peak_bytes": 900_000 + len(order), "budget_bytes": 10**6,
                   "mean_checkpointed_blocks": 1.5, "planner": {}}
        return mimose_cli.launcher.train.RunResult(run_dir, summary)

    monkeypatch.setattr(mimose_cli.launcher.sweep, "run_training", run_training)
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--baselines", "",
                                      "--budgets", "1MB", "--repeats", "3", "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert order == ["mimose", "none", "oracle", "none", "oracle", "mimose", "oracle", "mimose", "none"]
    entry = json.loads((tmp_path / "c" / "compare.json").read_text())["budgets"][0]
    rows = {r["planner"]: r for r in entry["runs"]}
    assert rows["mimose"]["train_time_s"] == 11.0 and rows["mimose"]["train_times_s"] == [12.0, 9.0, 11.0]
    assert rows["none"]["train_time_s"] == 10.0 and rows["mimose"]["normalised_time"] == pytest.approx(1.1)
    assert rows["oracle"]["status"] == "oom" and len(rows["oracle"]["run_dirs"]) == 3
    assert rows["none"]["peak_bytes"] == 900_009  # the largest of the rounds
    assert "median of 3 rounds" in result.output and "1.50" in result.output
    # none's rounds took 10, 10 and 30 s: 200 % apart, the widest spread, so more rounds are suggested
    assert "none at 1MB spread 200% across rounds" in result.output and "--repeats 5" in result.output


def test_timings_within_the_noise_suggest_no_more_rounds():
    from mimose_cli.runs.compare import timing_noise

    rows = [{"planner": "mimose", "train_times_s": [10.0, 10.2, 10.1]}, {"planner": "none", "train_times_s": [9.0, 9.1]}]
    note, more = timing_noise({"repeats": 3, "budgets": [{"budget": "1GB", "runs": rows}]})
    assert not more and "within 2.0% across rounds" in note


def test_an_interrupted_run_stops_the_comparison_and_no_run_keeps_checkpoints(monkeypatch, tmp_path):
    """A run that SIGTERM stopped stops the comparison: the command exits 143 (as ``train`` does)
    and compare.json says it was interrupted, and where."""
    calls = []

    def run_training(recipe, *, out_dir=None, view="auto", console=None, recipe_name="run", save=True):
        calls.append(save)
        run_dir = out_dir / f"{recipe_name}-{len(calls)}"
        run_dir.mkdir(parents=True)
        summary = {"status": "interrupted" if len(calls) == 2 else "completed", "steps": 5, "oom_steps": 0,
                   "train_time_s": 10.0, "peak_bytes": 900_000, "budget_bytes": 10**6, "planner": {},
                   "signal": "SIGTERM" if len(calls) == 2 else None}
        return mimose_cli.launcher.train.RunResult(run_dir, summary)

    monkeypatch.setattr(mimose_cli.launcher.sweep, "run_training", run_training)
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--baselines", "sublinear,dtr",
                                      "--budgets", "1MB,2MB", "--out", str(tmp_path / "c")])
    assert result.exit_code == 143, result.output
    assert calls == [False, False]
    assert "interrupted by SIGTERM at run 2 of 10: the comparison stopped there" in " ".join(result.output.split())
    data = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert (data["status"], data["signal"], data["runs_done"], data["runs_total"]) == ("interrupted", "SIGTERM", 2, 10)
    assert len(data["budgets"]) == 1 and [r["status"] for r in data["budgets"][0]["runs"]] == ["completed", "interrupted"]


def test_ctrl_c_in_round_two_exits_130_and_says_how_many_rounds_ran(fake_training, monkeypatch, tmp_path):
    """Ctrl-C that escapes a run (raised as KeyboardInterrupt) in the second of 3 rounds: exit 130,
    and neither the tables nor compare.json claim medians of 3 rounds: each row has its rounds."""
    inner = mimose_cli.launcher.sweep.run_training

    def run_training(recipe, **kwargs):
        if len(fake_training) == 3:  # mimose, none and oracle ran; none again, round 2, is stopped
            raise KeyboardInterrupt
        return inner(recipe, **kwargs)

    monkeypatch.setattr(mimose_cli.launcher.sweep, "run_training", run_training)
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--baselines", "", "--budgets", "2MB",
                                      "--repeats", "3", "--out", str(tmp_path / "c")])
    assert result.exit_code == 130, result.output
    assert len(fake_training) == 3
    data = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert (data["status"], data["signal"], data["runs_done"]) == ("interrupted", "SIGINT", 4)
    rows = {r["planner"]: r for r in data["budgets"][0]["runs"]}
    assert {name: (r["status"], r["rounds"]) for name, r in rows.items()} == {
        "mimose": ("completed", 1), "none": ("interrupted", 2), "oracle": ("completed", 1)}
    text = " ".join(result.output.split())
    assert "median of 3 rounds" not in text and "median of 1 to 3 rounds (stopped early)" in text
    assert "completed (1/3 rounds)" in text and "interrupted by SIGINT at run 4 of 9" in text
    report = CliRunner().invoke(app, ["report", str(tmp_path / "c"), "--no-plots"])
    assert report.exit_code == 0 and "timings are medians of 1 to 3 rounds" in " ".join(report.output.split())


def test_the_recipes_own_planner_is_compared(fake_training, tmp_path):
    """A recipe written for dtr compares dtr, with its own options, though the baselines leave it out."""
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--baselines", "sublinear", "--budgets", "2MB",
                                      "--out", str(tmp_path / "c"), "planner.name=dtr"])
    assert result.exit_code == 0, result.output
    assert [c[0] for c in fake_training] == ["mimose", "sublinear", "dtr", "none", "oracle"]
    assert json.loads((tmp_path / "c" / "compare.json").read_text())["planners"] == [
        "mimose", "sublinear", "dtr", "none", "oracle"]


def test_one_budget_spelled_three_ways_runs_once_and_says_so(fake_training, tmp_path):
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--baselines", "", "--budgets",
                                      "40MB,40000000,40 MB,2MB", "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert [(c[0], c[1]) for c in fake_training] == [(name, budget) for budget in ("40MB", "2MB")
                                                     for name in ("mimose", "none", "oracle")]
    text = " ".join(result.output.split())
    assert "budget '40000000' is 40MB again (40000000 bytes); it runs once, as 40MB" in text
    assert "budget '40 MB' is 40MB again" in text
    data = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert [b["budget"] for b in data["budgets"]] == ["40MB", "2MB"] and data["runs_total"] == 6


def test_repeats_must_be_positive():
    with pytest.raises(ValueError, match="repeats"):
        from mimose_cli.launcher.sweep import run_compare
        run_compare(load_recipe(str(QUICKSTART)), repeats=0)


def test_bad_budget_is_refused_before_any_run(fake_training, tmp_path):
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--budgets", "1MB,lots",
                                      "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and fake_training == []
    assert "budgets to compare: budget='lots' is invalid" in result.output


def test_compare_runs_real_training_and_writes_each_run(tmp_path):
    """The real loop (no fake): mimose, none and oracle, 4 steps each on the quickstart cut small;
    at 8MB none runs out of memory on the 4th batch (9.8 MB), so oracle is the reference."""
    out = tmp_path / "cmp"
    tiny = ["training.batch_size=2", "data.num_examples=32", "data.num_choices=2", "data.max_length=64",
            "planner.mimose.sheltered_steps=3"]
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--baselines", "", "--budgets", "8MB",
                                      "--steps", "4", "--out", str(out), *tiny])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "compare.json").read_text())
    assert data["planners"] == ["mimose", "none", "oracle"] and data["steps"] == 4
    (entry,) = data["budgets"]
    rows = {r["planner"]: r for r in entry["runs"]}
    assert rows["none"]["status"] == "oom" and rows["none"]["steps"] == 3 and rows["none"]["oom_steps"] == 1
    assert entry["reference"] == "oracle" and rows["oracle"]["normalised_time"] == 1.0
    for name in ("mimose", "oracle"):
        assert rows[name]["status"] == "completed" and rows[name]["steps"] == 4
        assert rows[name]["peak_bytes"] <= entry["budget_bytes"] == 8 * 10**6
        assert rows[name]["normalised_time"] > 0
    for row in rows.values():  # each row is read from its own run directory
        summary = json.loads((out / row["run_dir"] / "summary.json").read_text())
        assert (summary["status"], summary["steps"], summary["peak_bytes"]) == (row["status"], row["steps"], row["peak_bytes"])
    assert "budget 8MB" in result.output


def test_two_compares_started_in_the_same_second_each_get_their_own_directory(fake_training, tmp_path,
                                                                             monkeypatch):
    import io

    from mimose_cli.launcher.sweep import run_compare

    monkeypatch.setattr("mimose_cli.launcher.sweep.time.strftime", lambda fmt: "20260101-000000")
    recipe = load_recipe(str(QUICKSTART), [f"out_dir={tmp_path}"])
    dirs = [run_compare(recipe, baselines=[], budgets=["2MB"], recipe_name="q",
                        console=Console(file=io.StringIO())) for _ in range(2)]
    assert [d.name for d in dirs] == ["compare-20260101-000000-q", "compare-20260101-000000-q-2"]
    assert all(json.loads((d / "compare.json").read_text())["budgets"] for d in dirs)


def test_a_bad_variant_is_refused_before_the_first_run(fake_training, tmp_path):
    result = CliRunner().invoke(app, ["compare", str(QUICKSTART), "--baselines", "sublinear:fast",
                                      "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and fake_training == [] and not (tmp_path / "c").exists()
    assert "planner.sublinear.variant='fast'" in result.output


@pytest.mark.parametrize("phase, said", [("sheltered", True), ("responsive", False)])
def test_a_comparison_shorter_than_the_sheltered_phase_says_so(tmp_path, phase, said):
    row = {"planner": "mimose", "status": "completed", "steps": 5, "train_time_s": 1.0, "phase": phase}
    (tmp_path / "compare.json").write_text(json.dumps(
        {"recipe": "q", "steps": 5, "seed": 0, "repeats": 1,
         "budgets": [{"budget": "40MB", "budget_bytes": 40_000_000, "reference": None, "runs": [row]}]}))
    console = Console(record=True, width=200)
    render_compare(tmp_path, console)
    assert ("spent every step of this comparison in its sheltered phase" in console.export_text()) == said


def test_overrides_without_a_recipe_apply_to_the_default_one(fake_training, tmp_path):
    """``mimose compare training.max_steps=3``: the recipe defaults to the quickstart, so an
    argument ``key=value`` that is no file is an override of it, not a missing recipe file."""
    result = CliRunner().invoke(app, ["compare", "training.max_steps=3", "--baselines", "", "--budgets", "40MB",
                                      "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert {c[2] for c in fake_training} == {3}
