import json
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForMultipleChoice

from mimose_cli.launcher import checkpoint
from mimose_cli.launcher.checkpoint import CHECKPOINT, Progress, load_checkpoint, save_checkpoint
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.train import run_training
from mimose_cli.runs.report import render

from helpers import QUICK_OVERRIDES, QUICKSTART


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 6-step run with a checkpoint every 4 steps (so: after step 4, and the last at 6)."""
    out = tmp_path_factory.mktemp("runs")
    recipe = load_recipe(QUICKSTART, QUICK_OVERRIDES + [f"out_dir={out}", "training.checkpoint_every=4"])
    return run_training(recipe, view="none")


def test_checkpoint_holds_every_state_and_loads_with_weights_only(finished):
    state = torch.load(finished.run_dir / CHECKPOINT, weights_only=True)
    assert set(state) == {"format", "progress", "model", "optimizer", "scheduler", "scaler", "recipe", "rng", "planner",
                          "world_size", "other_ranks"}
    assert (state["world_size"], state["other_ranks"]) == (1, [])
    # 6 steps of 4 examples over 48 examples: 12 batches per epoch, 6 done.
    assert state["progress"]["step"] == 6 and (state["progress"]["epoch"], state["progress"]["batch"]) == (0, 6)
    assert state["scheduler"]["last_epoch"] == 6 and state["scaler"] is None
    assert all(s["step"].item() == 6 for s in state["optimizer"]["state"].values())
    assert isinstance(state["rng"]["torch"], torch.ByteTensor)
    planner = json.loads(state["planner"])
    assert planner["name"] == "mimose" and planner["estimator"]["fitted"] is not None
    assert finished.summary["checkpoint_step"] == 6


def test_progress_counts_micro_batches_across_epochs():
    at = Progress.at_step(7, micro_batches_per_step=2, batches_per_epoch=5)
    assert (at.step, at.epoch, at.batch) == (7, 2, 4)


def test_progress_advances_from_a_start_whose_batches_were_of_another_size():
    """From a fresh start or a resume on as many processes, the position is ``at_step``'s; from a
    resume on another number of processes (batches of 4 x 2 examples before, 4 x 3 now: 7 batches
    of 8 are 56 examples, 4 batches of 12 and 8 examples trained again) it counts on from there."""
    for start in (Progress(), Progress.at_step(4, 2, 5)):
        assert start.advanced(7, 2, 5) == Progress.at_step(7, 2, 5)
    regrouped = Progress(step=7, epoch=1, batch=7, wall_s=3.0).regrouped(batch_size=4, saved_processes=2, processes=3)
    assert (regrouped.step, regrouped.epoch, regrouped.batch, regrouped.wall_s) == (7, 1, 4, 3.0)
    later = regrouped.advanced(9, micro_batches_per_step=1, batches_per_epoch=5)
    assert (later.step, later.epoch, later.batch) == (9, 2, 1)


def test_the_model_is_saved_for_from_pretrained(finished):
    model_dir = finished.run_dir / "model"
    assert (model_dir / "model.safetensors").exists() and finished.summary["model_dir"] == "model"
    loaded = AutoModelForMultipleChoice.from_pretrained(model_dir)
    trained = torch.load(finished.run_dir / CHECKPOINT, weights_only=True)["model"]
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_report_says_where_the_model_and_the_checkpoint_are(finished):
    console = Console(record=True, width=400)
    render(finished.run_dir, console)
    text = console.export_text()
    assert f"model: {finished.run_dir / 'model'}" in text
    assert f"checkpoint at step 6: {finished.run_dir / CHECKPOINT}" in text and "--resume" in text


def test_a_run_without_checkpoint_cannot_be_loaded(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint.pt"):
        load_checkpoint(tmp_path)


def _trainer(weight: float):
    """What ``save_checkpoint`` reads of a trainer, around a one-weight model."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return SimpleNamespace(model=model, optimizer=optimizer, scaler=None, device=torch.device("cpu"),
                           scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                           recipe=load_recipe(QUICKSTART, QUICK_OVERRIDES),
                           planner=SimpleNamespace(state_dict=lambda: {"name": "none"}))


def test_a_save_cut_off_mid_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _trainer(1.0), Progress(step=4))

    def cut_off(state, file):  # what a full disk does: part of the file, then an error
        file.write(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", cut_off)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, _trainer(2.0), Progress(step=6))
    assert not (tmp_path / f".{CHECKPOINT}.tmp").exists()
    kept = load_checkpoint(tmp_path)
    assert kept["progress"]["step"] == 4 and kept["model"]["weight"].item() == 1.0


def test_every_file_of_a_run_is_as_readable_as_its_metrics(finished):
    """Atomic writes go through temporary files (0600); the run's files still get the umask's mode."""
    run_dir = finished.run_dir
    mode = (run_dir / "metrics.jsonl").stat().st_mode & 0o777
    written = [run_dir / name for name in ("summary.json", "recipe.yaml", "env.json")]
    written += list((run_dir / "model").iterdir())
    assert {path.name: path.stat().st_mode & 0o777 for path in written} == {path.name: mode for path in written}
