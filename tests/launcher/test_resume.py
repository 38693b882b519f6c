import json
import os
import shutil
import signal

import pytest
import torch
from rich.console import Console

from mimose_cli.launcher.recipe import RecipeError, load_recipe
from mimose_cli.launcher.resume import cut_records, resume_recipe
from mimose_cli.launcher.train import run_training
from mimose_cli.runs.report import render
from mimose_cli.runs.rundir import RunWriter

from helpers import QUICK_OVERRIDES, QUICKSTART


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(d["step"], d["micro_step"], d["loss"]) for d in map(json.loads, lines)]


@pytest.fixture(scope="module")
def completed(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return run_training(load_recipe(QUICKSTART, QUICK_OVERRIDES + [f"out_dir={out}"]), view="none")


def test_resume_keeps_the_recipe_but_may_raise_max_steps(completed):
    recipe = resume_recipe(completed.run_dir, ["training.max_steps=9"])
    assert recipe.training.max_steps == 9 and recipe.budget == "40MB"
    with pytest.raises(RecipeError, match=r"budget is '40MB' in that run, not '1GB'.*training.max_steps"):
        resume_recipe(completed.run_dir, [], {"budget": "1GB"})
    with pytest.raises(RecipeError, match="training.lr"):
        resume_recipe(completed.run_dir, ["training.lr=0.1"])
    assert resume_recipe(completed.run_dir, [], {"device": "cpu"}).device == "cpu"  # unchanged: fine


def test_resume_warns_of_the_recipe_it_resumes_with_not_of_the_one_it_ran(completed, tmp_path, recwarn):
    """A run of 3 steps with 5 of warm-up (it warned when the run began); resumed with 9 steps the
    warning no longer holds, and is not said again; resumed as it was, it still is."""
    run_dir = tmp_path / "run"
    shutil.copytree(completed.run_dir, run_dir)
    saved = run_dir / "recipe.yaml"
    saved.write_text(saved.read_text().replace("max_steps: 6", "max_steps: 3"))
    resume_recipe(run_dir, ["training.max_steps=9"])
    assert not [w for w in recwarn if "warmup_steps" in str(w.message)]
    with pytest.warns(UserWarning, match="warmup_steps=5 is longer than the run"):
        resume_recipe(run_dir)


def test_resume_needs_a_run_directory_with_a_checkpoint(tmp_path, completed):
    with pytest.raises(RecipeError, match="not a run directory"):
        resume_recipe(tmp_path)
    (tmp_path / "recipe.yaml").write_text((completed.run_dir / "recipe.yaml").read_text())
    with pytest.raises(RecipeError, match="no checkpoint.pt"):
        resume_recipe(tmp_path)
    (tmp_path / "checkpoint" / ".step-00000004.tmp").mkdir(parents=True)  # a sharded save cut short: nothing
    with pytest.raises(RecipeError, match="no checkpoint.pt"):
        resume_recipe(tmp_path)
    (tmp_path / "checkpoint" / "current").write_text("step-00000004\n")  # a sharded one (training.parallel=fsdp)
    assert resume_recipe(tmp_path).training.max_steps == completed.summary["optimizer_steps"]
    (tmp_path / "summary.json").write_text(json.dumps({**completed.summary, "checkpoint_step": 4}))
    (tmp_path / "metrics.jsonl").write_text((completed.run_dir / "metrics.jsonl").read_text())
    console = Console(record=True, width=400)
    render(tmp_path, console, plots=False)
    assert f"checkpoint at step 4: {tmp_path / 'checkpoint'} (mimose train --resume {tmp_path}" in console.export_text()


def test_resuming_a_completed_run_trains_the_added_steps_only(completed, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(completed.run_dir, run_dir)
    with pytest.raises(ValueError, match="raise training.max_steps"):
        run_training(resume_recipe(run_dir), view="none", resume=run_dir)
    more = run_training(resume_recipe(run_dir, ["training.max_steps=8"]), view="none", resume=run_dir)
    assert [s for s, _, _ in _losses(run_dir)] == list(range(8))
    assert _losses(run_dir)[:6] == _losses(completed.run_dir)  # the same ops in the same order: bit for bit
    assert more.summary["steps"] == 8 and more.summary["resumed_from_steps"] == [6]
    assert more.summary["planner"]["steps"] == 8  # the planner's counters carry over


def test_cut_records_keeps_earlier_lines_byte_for_byte(completed, tmp_path):
    lines = (completed.run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 6, "lo')
    (tmp_path / "plans.jsonl").write_text((completed.run_dir / "plans.jsonl").read_text())
    (tmp_path / "summary.json").write_text((completed.run_dir / "summary.json").read_text())
    kept = cut_records(tmp_path, 4, 1)
    assert not (tmp_path / "summary.json").exists()  # it described 6 steps, 2 of them now gone
    assert [r.step for r in kept] == [0, 1, 2, 3]
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:4])
    assert len((tmp_path / "plans.jsonl").read_text().splitlines()) == 4
    with pytest.raises(ValueError, match="one record per micro-batch"):
        cut_records(tmp_path, 5, 1)  # step 4 is gone: it cannot be resumed from step 5


def test_sigterm_inside_an_accumulation_window_stops_at_its_end(tmp_path, monkeypatch):
    """A signal between two micro-batches of a step: the step is finished, the checkpoint taken
    after it, and the resumed run equals the uninterrupted one bit for bit."""
    overrides = QUICK_OVERRIDES + ["training.max_steps=4", "training.gradient_accumulation_steps=2"]
    reference = run_training(load_recipe(QUICKSTART, overrides + [f"out_dir={tmp_path / 'a'}"]), view="none")
    original = RunWriter.metric

    def metric(self, record):
        original(self, record)
        if (record.step, record.micro_step) == (1, 0):
            os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as patch:
        patch.setattr(RunWriter, "metric", metric)
        stopped = run_training(load_recipe(QUICKSTART, overrides + [f"out_dir={tmp_path / 'b'}"]), view="none")
    assert signal.getsignal(signal.SIGTERM) is handler  # put back after the run
    assert stopped.summary["status"] == "interrupted" and stopped.exit_code == 143
    assert stopped.summary["checkpoint_step"] == 2 and len(stopped.records) == 4
    run_training(resume_recipe(stopped.run_dir), view="none", resume=stopped.run_dir)
    assert _losses(stopped.run_dir) == _losses(reference.run_dir)  # same batches and plans: bit for bit


def test_a_second_writer_is_refused_before_it_touches_the_run(completed, tmp_path):
    import shutil

    from mimose_cli.runs.rundir import RunLock

    run_dir = tmp_path / "run"
    shutil.copytree(completed.run_dir, run_dir)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".mimose.lock"}
    with RunLock(run_dir):  # a first --resume, still training
        with pytest.raises(ValueError, match="is being written by process"):
            run_training(resume_recipe(run_dir, ["training.max_steps=8"]), view="none", resume=run_dir)
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".mimose.lock"}
    assert after == before  # summary, records and checkpoint as they were


def test_a_run_whose_final_save_was_cut_finishes_it_on_resume(completed, tmp_path):
    """A second Ctrl-C while the model was written: the checkpoint of the last step is there, the
    model and the summary are not (a stray temporary model directory instead)."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(completed.run_dir, run_dir)
    shutil.rmtree(run_dir / "model")
    (run_dir / "summary.json").unlink()
    (run_dir / ".model.tmp").mkdir()
    records = (run_dir / "metrics.jsonl").read_text()
    done = run_training(resume_recipe(run_dir), view="none", resume=run_dir)
    assert done.summary["status"] == "completed" and done.summary["steps"] == completed.summary["steps"]
    assert (run_dir / "model" / "config.json").is_file() and not (run_dir / ".model.tmp").exists()
    assert (run_dir / "metrics.jsonl").read_text() == records  # nothing trained again
    with pytest.raises(ValueError, match="raise training.max_steps"):  # now whole: nothing left to do
        run_training(resume_recipe(run_dir), view="none", resume=run_dir)


@pytest.mark.parametrize("break_it, said", [
    (lambda state: state.pop("optimizer"), "the checkpoint has no optimizer entry: it is incomplete"),
    (lambda state: state.pop("rng"), "the checkpoint has no rng entry"),
    (lambda state: state["model"].update({k: torch.zeros(3) for k in list(state["model"])[:1]}),
     r"has shape \(3,\) in the checkpoint and .* in this recipe's model: the checkpoint is of another model"),
    (lambda state: state["model"].pop(next(iter(state["model"]))), "is in this recipe's model only"),
    (lambda state: next(iter(state["model"].values())).view(-1)[0].fill_(float("nan")),
     r"checkpoint.pt holds non-finite weights \(\S+ has NaN\): the run had diverged"),
])
def test_a_checkpoint_that_cannot_resume_is_refused_before_any_file_changes(completed, tmp_path, break_it, said):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(completed.run_dir, run_dir)
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    break_it(state)
    torch.save(state, run_dir / "checkpoint.pt")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match=said):
        run_training(resume_recipe(run_dir, ["training.max_steps=8"]), view="none", resume=run_dir)
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".mimose.lock"}
    assert after == {k: v for k, v in before.items() if k != ".mimose.lock"}  # summary.json kept, records uncut


def test_a_recipe_yaml_edited_since_the_checkpoint_is_refused(completed, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(completed.run_dir, run_dir)
    recipe = run_dir / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("lr: 0.002", "lr: 0.01"))
    with pytest.raises(ValueError, match=r"training.lr is 0.01 in the recipe now but the run was trained with 0.002"):
        run_training(resume_recipe(run_dir, ["training.max_steps=8"]), view="none", resume=run_dir)


def test_a_summary_with_values_no_run_writes_does_not_stop_a_resume(completed, tmp_path):
    import json
    import shutil

    from typer.testing import CliRunner

    from mimose_cli.cli import app

    run_dir = tmp_path / "run"
    shutil.copytree(completed.run_dir, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "world_size": "two"}))
    result = CliRunner().invoke(app, ["train", "--resume", str(run_dir), "--max-steps", "7", "--view", "none"])
    assert result.exit_code == 0, result.output
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 7


@pytest.mark.parametrize("make, said", [
    (lambda path: path.write_bytes(bytes(range(256)) * 4), "is not a checkpoint mimose wrote, or is corrupt"),
    (lambda path: path.write_bytes(path.read_bytes()[:1000]), "is not a checkpoint mimose wrote, or is corrupt"),
    (lambda path: (path.unlink(), path.mkdir()), "checkpoint.pt is a directory, not a checkpoint file"),
])
def test_a_checkpoint_that_is_not_one_is_named_without_torch_s_advice(completed, tmp_path, make, said):
    """Random bytes, a cut-off file, a directory: one line naming it, never torch's suggestion to
    load with weights_only=False (wrong for a corrupt file, and unsafe) nor "no checkpoint"."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(completed.run_dir, run_dir)
    make(run_dir / "checkpoint.pt")
    with pytest.raises(ValueError, match=said) as error:
        run_training(resume_recipe(run_dir, ["training.max_steps=8"]), view="none", resume=run_dir)
    assert "weights_only" not in str(error.value) and "\n" not in str(error.value)
