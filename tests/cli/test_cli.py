import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mimose_cli.cli import app

from helpers import QUICKSTART, ROOT

runner = CliRunner()
QUICK = str(QUICKSTART)
ROOT_ARGS = ["training.max_steps=3", "training.batch_size=2", "data.num_examples=16"]


def test_train_then_report_via_cli(tmp_path):
    # Mimose's option under --planner full: valid in the recipe, read by no one in this run: said.
    with pytest.warns(UserWarning, match="override 'planner.mimose.choices=selective' has no effect: this run's "
                                         "planner is full, which reads planner.full only"):
        result = runner.invoke(app, ["train", QUICK, "--planner", "full",
                                     "--budget", "200MB", "--out", str(tmp_path), "--view", "plain",
                                     *ROOT_ARGS, "planner.mimose.choices=selective"])
    assert result.exit_code == 0, result.output
    assert "step 2/3" in result.output
    (run_dir,) = list(tmp_path.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["budget_bytes"] == 200 * 10**6
    report = runner.invoke(app, ["report", str(run_dir)])
    assert report.exit_code == 0, report.output
    assert "summary" in report.output and "per-iteration statistics" in report.output
    for output in (result.output, report.output):  # full: no estimate, no plan cache, no trust
        assert "planner: full" in output and "retried steps / retries" in output
        assert not any(word in output for word in ("estimate from", "plan cache", "steps measured", "sheltered"))


def _row_labels(output: str) -> list:
    """The first cell of every row of the tables in ``output``."""
    return [line.split("│")[1].strip() for line in output.splitlines() if line.startswith("│")]


def test_the_end_of_a_run_and_its_report_show_the_planner_in_words_and_stats_its_counters(tmp_path):
    """A quickstart-like Mimose run: its end and ``report`` show the planner's table in words, no
    row named by a counter; ``report --stats`` prints every counter of summary.json's planner."""
    result = runner.invoke(app, ["train", QUICK, "--out", str(tmp_path), "--view", "plain", *ROOT_ARGS])
    assert result.exit_code == 0, result.output
    (run_dir,) = list(tmp_path.iterdir())
    report = runner.invoke(app, ["report", str(run_dir), "--no-plots"])
    stats = runner.invoke(app, ["report", str(run_dir), "--no-plots", "--stats"])
    assert report.exit_code == stats.exit_code == 0, report.output + stats.output
    for output in (result.output, report.output):
        assert "planner: mimose" in output and "estimate from" in output and "probes:" in output
        assert "plan cache hit rate" in output and "planning overhead" in output and "iterations of" in output
        assert not [label for label in _row_labels(output) if re.fullmatch(r"[a-z]+(_[a-z]+)+", label)]
        assert "sheltered" not in output  # the probes gave the estimate: no sheltered phase
    counters = json.loads((run_dir / "summary.json").read_text())["planner"]
    assert "probe_twins" not in report.output
    assert stats.output.startswith(report.output.split("per-iteration")[0])
    assert set(counters) - {"planner"} <= set(_row_labels(stats.output))


def test_train_out_of_memory_exits_nonzero_with_message(tmp_path):
    result = runner.invoke(app, ["train", QUICK, "--planner", "none",
                                 "--budget", "5MB", "--out", str(tmp_path), "--view", "plain",
                                 *ROOT_ARGS])
    assert result.exit_code == 1
    # 5MB is below what the step needs with every block checkpointed: the pre-flight says so.
    assert result.output.count("budget 5MB (4.77 MiB) is too small") == 1  # said once, as written
    assert "summary" not in result.output  # no step ran: no table of zeros
    (run_dir,) = list(tmp_path.iterdir())
    report = runner.invoke(app, ["report", str(run_dir)])  # no step to plot: said, not a traceback
    assert report.exit_code == 0, report.output
    assert "plot not drawn: memory.png (no step recorded in metrics.jsonl)" in report.output


def test_report_plots_a_run_that_ran_out_of_memory(tmp_path):
    from mimose_cli.runs.plots import run_figures

    result = runner.invoke(app, ["train", QUICK, "--planner", "none", "--budget", "30MB", "--out", str(tmp_path),
                                 "training.max_steps=6", "training.batch_size=4", "data.num_examples=48"])
    assert result.exit_code == 1 and "step 3 ran out of memory" in result.output
    (run_dir,) = list(tmp_path.iterdir())
    report = runner.invoke(app, ["report", str(run_dir), "--no-plots"])
    assert report.exit_code == 0 and "plot" not in report.output and not (run_dir / "plots").exists()
    report = runner.invoke(app, ["report", str(run_dir)])
    assert report.exit_code == 0, report.output
    lines = report.output.splitlines()
    for name in ("memory.png", "input_size.png", "plan.png"):
        assert f"plot: {run_dir / 'plots' / name}" in lines and (run_dir / "plots" / name).stat().st_size > 8_000
    assert ("plot not drawn: estimator.png (no estimator.json in the run directory (only the mimose planner "
            "keeps one))") in lines
    memory = run_figures(run_dir)["memory.png"].axes[0]
    oom = [c for c in memory.collections if c.get_label() == "out of memory (bytes reached)"]
    assert len(oom) == 1 and list(oom[0].get_offsets()[:, 0]) == [3]  # the fourth step


def test_bad_recipe_key_exits_2_naming_the_key(tmp_path):
    result = runner.invoke(app, ["train", QUICK, "training.nope=1"])
    assert result.exit_code == 2
    assert "training.nope" in result.output


def test_bad_budget_flag_is_rejected():
    result = runner.invoke(app, ["train", QUICK, "--budget", "lots"])
    assert result.exit_code == 2
    assert "budget" in result.output


def test_report_on_missing_directory(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "not a run directory" in result.output


def test_python_dash_m_entry_point():
    # From the repository root, so the package under test runs, not an installed copy.
    out = subprocess.run([sys.executable, "-m", "mimose_cli", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "train" in out.stdout and "report" in out.stdout


@pytest.mark.parametrize("args, named", [
    (["train", QUICK, "--bogus"], "No such option: --bogus"),
    (["train"], "missing RECIPE"),
    (["compare", QUICK, "--steps", "abc"], "Invalid value for '--steps'"),
    (["nope"], "No such command 'nope'"),
])
def test_usage_errors_of_the_entry_point_are_one_line(args, named):
    out = subprocess.run([sys.executable, "-m", "mimose_cli", *args], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"error: {named}") and out.stderr.count("\n") == 1


def test_resume_continues_a_run_and_rejects_what_would_change_it(tmp_path):
    first = runner.invoke(app, ["train", QUICK, "--planner", "full", "--budget", "200MB", "--out", str(tmp_path),
                                "--view", "none", *ROOT_ARGS])
    assert first.exit_code == 0, first.output
    (run_dir,) = list(tmp_path.iterdir())
    changed = runner.invoke(app, ["train", "--resume", str(run_dir), "--budget", "300MB"])
    assert changed.exit_code == 2 and changed.output.count("\n") == 1
    assert "error: cannot resume" in changed.output and "budget is '200MB' in that run" in changed.output
    with_recipe = runner.invoke(app, ["train", QUICK, "--resume", str(run_dir)])
    assert with_recipe.exit_code == 2 and "leave out" in with_recipe.output
    done = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert done.exit_code == 2 and "raise training.max_steps" in done.output
    more = runner.invoke(app, ["train", "--resume", str(run_dir), "training.max_steps=5", "--view", "plain"])
    assert more.exit_code == 0, more.output
    assert f"resuming {run_dir} at step 3 of 5" in more.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["resumed_from_steps"] == [3]


def test_resume_without_checkpoint_and_train_without_recipe_say_so(tmp_path):
    (tmp_path / "recipe.yaml").write_text("budget: 40MB\n")
    result = runner.invoke(app, ["train", "--resume", str(tmp_path)])
    assert result.exit_code == 2 and "no checkpoint.pt" in result.output and result.output.count("\n") == 1
    result = runner.invoke(app, ["train"])
    assert result.exit_code == 2 and "missing RECIPE" in result.output


def test_version_recipes_and_compare_without_a_recipe(monkeypatch, tmp_path):
    from mimose_cli import __version__
    from mimose_cli.launcher import sweep as compare_module

    assert runner.invoke(app, ["--version"]).output.strip() == f"mimose {__version__}"
    listing = runner.invoke(app, ["recipes"])
    assert listing.exit_code == 0
    lines = listing.output.splitlines()
    assert len(lines) == len(list((ROOT / "recipes").glob("*.yaml"))) >= 5
    assert any(line.startswith("recipes/quickstart.yaml") and "tiny BERT" in line for line in lines)
    seen = {}

    def run_compare(recipe, **kw):
        seen.update(recipe=recipe, **kw)
        kw["out"].mkdir()
        (kw["out"] / "compare.json").write_text('{"repeats": 1, "budgets": []}')
        return kw["out"]

    monkeypatch.setattr(compare_module, "run_compare", run_compare)
    result = runner.invoke(app, ["compare", "--baselines", "sublinear,dtr", "--steps", "2",
                                 "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert "default" in result.output and "quickstart.yaml" in result.output
    assert seen["recipe_name"] == "quickstart" and seen["baselines"] == ["sublinear", "dtr"]


def test_a_quiet_run_still_says_where_it_went_and_its_report_survives_a_closed_pipe(tmp_path):
    result = runner.invoke(app, ["train", QUICK, "--planner", "full", "--out", str(tmp_path), "--view", "none",
                                 *ROOT_ARGS])
    (run_dir,) = list(tmp_path.iterdir())
    assert result.exit_code == 0 and result.output.strip() == f"run directory: {run_dir}"
    # `mimose report RUN | head -1`: the reader goes away after one line; the plots are written
    # first and the command ends quietly as SIGPIPE would.
    report = subprocess.Popen([sys.executable, "-m", "mimose_cli", "report", str(run_dir)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    report.stdout.readline()
    report.stdout.close()
    assert report.wait(timeout=120) == 141 and report.stderr.read() == b""
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == [
        "input_size.png", "memory.png", "plan.png"]  # no estimator: the full planner keeps none
    (run_dir / "plots").rename(run_dir / "plots-old")
    (run_dir / "plots").write_text("in the way")
    blocked = runner.invoke(app, ["report", str(run_dir)])
    assert blocked.exit_code == 2 and "plots is a file, where the plots go" in blocked.output


def test_a_run_of_two_processes_resumes_with_two_said_before_anything_is_built(tmp_path, monkeypatch):
    import mimose_cli.launcher.train

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text(QUICKSTART.read_text())
    (run_dir / "summary.json").write_text(json.dumps({"status": "interrupted", "world_size": 2}))
    (run_dir / "checkpoint.pt").write_bytes(b"")  # never read: the summary says it all
    monkeypatch.setattr(mimose_cli.launcher.train, "run_training", lambda *a, **k: pytest.fail("built the run"))
    result = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert result.exit_code == 2
    assert f"resume it with mimose train --resume {run_dir} --nproc-per-node 2" in result.output


@pytest.mark.parametrize("rank", [0, 1])
def test_an_idle_override_is_said_by_the_launching_process_only(rank, monkeypatch):
    """Under torchrun every rank reads the same overrides: the warning that one has no effect is
    said once, by rank 0 (a command refused right after it stops here before anything is built)."""
    import warnings

    import mimose_cli.launcher.spawn

    monkeypatch.setattr(mimose_cli.launcher.spawn, "other_rank", lambda: rank == 1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        result = runner.invoke(app, ["train", QUICK, "--planner", "sublinear", "planner.mimose.choices=selective",
                                     "--nproc-per-node", "2", "--dry-run"])
    assert result.exit_code == 2
    idle = [w for w in said if "has no effect" in str(w.message)]
    assert len(idle) == (0 if rank else 1)


def _as_previous_release(line: dict) -> dict:
    """A record line as the previous release wrote it: the plan as four fields (the indices
    checkpointed, those of them selective, ``(block, level)`` partial, the offloaded ones)."""
    plan = line.get("plan") or []
    old = {**line, "plan": [i for i, c in enumerate(plan) if c not in ("keep", "offload")],
           "selective": [i for i, c in enumerate(plan) if c == "selective"],
           "partial": [[i, c] for i, c in enumerate(plan) if c.startswith("partial")],
           "offload": [i for i, c in enumerate(plan) if c == "offload"]}
    if line.get("ranks"):
        old["ranks"] = [{**rank, "plan": [i for i, c in enumerate(rank["plan"]) if c not in ("keep", "offload")]}
                        for rank in line["ranks"]]
    return old


def test_report_reads_a_run_directory_of_the_previous_release(tmp_path):
    """``mimose report`` on a run whose metrics.jsonl and plans.jsonl carry the plan as the previous
    release's four fields says what it says of the same run written as one choice per block."""
    result = runner.invoke(app, ["train", QUICK, "--budget", "40MB", "--out", str(tmp_path / "new"),
                                 "--view", "none", "training.max_steps=6", "training.batch_size=4",
                                 "data.num_examples=32", "planner.mimose.choices=selective"])
    assert result.exit_code == 0, result.output
    (run_dir,) = list((tmp_path / "new").iterdir())
    old_dir = tmp_path / "old" / run_dir.name
    old_dir.parent.mkdir()
    subprocess.run(["cp", "-r", str(run_dir), str(old_dir)], check=True)
    for name in ("metrics.jsonl", "plans.jsonl"):
        lines = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
        (old_dir / name).write_text("".join(json.dumps(_as_previous_release(line)) + "\n" for line in lines))
    plans = [json.loads(line)["plan"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("keep" in plan for plan in plans) and any(set(plan) - {"keep"} for plan in plans)
    reports = [runner.invoke(app, ["report", str(d)]) for d in (run_dir, old_dir)]
    assert [r.exit_code for r in reports] == [0, 0], reports[1].output
    assert reports[1].output.replace(str(old_dir), str(run_dir)) == reports[0].output
    assert (old_dir / "plots" / "plan.png").stat().st_size > 0


def test_ctrl_c_once_report_is_done_ends_in_one_line_and_130(tmp_path):
    """A Ctrl-C while Python shuts down after ``mimose report`` (here sent from an atexit callback,
    which runs before torch's own) is the one line and exit status of a Ctrl-C during it, not a
    traceback from whichever atexit callback it lands in."""
    row = {"planner": "mimose", "status": "completed", "steps": 5, "train_time_s": 1.0}
    (tmp_path / "compare.json").write_text(json.dumps(
        {"recipe": "q", "steps": 5, "seed": 0, "repeats": 1,
         "budgets": [{"budget": "40MB", "budget_bytes": 40_000_000, "reference": None, "runs": [row]}]}))
    script = ("import atexit, os, signal, sys\n"
              "from mimose_cli.cli import main\n"
              "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
              "sys.argv = ['mimose', 'report', sys.argv[1], '--no-plots']\n"
              "main()\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert "budget 40MB" in done.stdout  # the report was printed in full first
    assert (done.returncode, done.stderr) == (130, "error: interrupted\n")


def test_ctrl_c_while_the_cli_loads_ends_in_one_line_and_130(tmp_path):
    """A Ctrl-C while ``mimose`` is still importing its CLI (typer, rich: about a second) is the one
    line and exit status of a Ctrl-C during a command, not an import traceback. The signal is sent
    from inside that import, by a stand-in ``typer`` first on the path, so it lands there every time."""
    (tmp_path / "typer.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "mimose_cli", "report", str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=60)
    assert (done.returncode, done.stderr) == (130, "error: interrupted\n")
