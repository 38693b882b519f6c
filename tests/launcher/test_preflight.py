"""Pre-flight: the budgets a recipe needs, measured before the first step."""

import torch
from typer.testing import CliRunner

from mimose_cli.cli import app
from mimose_cli.launcher.data.loader import make_batch, max_input_size
from mimose_cli.launcher.models import model_config
from mimose_cli.launcher.preflight import measure_range, preflight
from mimose_cli.launcher.train import build_trainer, run_training
from mimose_cli.planners.trial import probe_with_plan

from helpers import QUICKSTART


def _trainer(recipe):
    """The recipe's trainer, its model's config, its planner and the largest input size."""
    config = model_config(recipe)
    trainer = build_trainer(recipe, config, total_steps=1)
    return trainer, config, trainer.planner, max_input_size(recipe)


def test_measuring_leaves_no_trace_and_brackets_the_peaks(quick_recipe):
    recipe = quick_recipe("budget=1GB")
    trainer, config, planner, size = _trainer(recipe)
    with trainer.meter.activate():
        trainer.meter.track(trainer.model)
        batch = trainer.to_device(make_batch(recipe, config, size))
        rng, weights = torch.get_rng_state(), [p.detach().clone() for p in trainer.model.parameters()]
        needs = measure_range(planner, batch, size, later_bytes=1000)
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(p.grad is None for p in trainer.model.parameters())
        assert all(torch.equal(p, w) for p, w in zip(trainer.model.parameters(), weights))
        assert planner.plan == ()
        assert trainer.meter.budget_bytes == recipe.budget_bytes  # lifted only while measuring
        live = trainer.meter.current_bytes()
    planner.close()
    assert needs.input_size == size
    assert live < needs.full_bytes < needs.none_bytes  # checkpointing every block needs less


def test_a_budget_below_every_plan_ends_before_the_first_step_with_both_figures(quick_recipe):
    probe = run_training(quick_recipe("training.max_steps=1", "planner.name=full"), view="none")
    needs = probe.summary["preflight"]
    assert needs["full_bytes"] < needs["none_bytes"]
    too_small = needs["full_bytes"] - 1
    result = run_training(quick_recipe(f"budget={too_small}"), view="none")
    assert result.summary["status"] == "oom" and result.records == []
    assert "too small for this recipe" in result.summary["error"]
    assert "with every block checkpointed" in result.summary["error"]
    # At exactly that figure, every block checkpointed runs the largest batch.
    fits = run_training(quick_recipe(f"budget={needs['full_bytes']}", "planner.name=full"), view="none")
    assert fits.summary["status"] == "completed"


def test_a_batch_beyond_the_hosts_memory_ends_the_run_with_its_summary(quick_recipe):
    """The largest batch cannot even be made (a MemoryError on the host): the run ends as one
    whose budget is too small does, its directory whole (summary, status, the error), not empty."""
    from mimose_cli.runs.rundir import load_run

    result = run_training(quick_recipe("training.batch_size=1000000000"), view="none")
    assert result.summary["status"] == "oom" and result.records == [] and result.exit_code == 1
    assert "does not fit in this machine's memory" in result.summary["error"]
    assert load_run(result.run_dir)[0]["status"] == "oom"  # not a run cut off ("interrupted")


def test_dry_run_prints_the_range_and_trains_nothing(tmp_path):
    out = tmp_path / "runs"
    ok = CliRunner().invoke(app, ["train", str(QUICKSTART), "--dry-run", "--out", str(out)])
    assert ok.exit_code == 0, ok.output
    assert "with every block checkpointed" in ok.output and "fits" in ok.output
    assert not out.exists()
    small = CliRunner().invoke(app, ["train", str(QUICKSTART), "--dry-run", "--budget", "5MB"])
    assert small.exit_code == 1 and "too small for this recipe" in small.output


def test_the_least_memory_figure_covers_a_padded_batch_of_the_largest_size(quick_recipe):
    """The pre-flight measures the planner's least-memory plan (every block checkpointed; with
    ``offload`` every block offloaded, which holds less) on a batch padded as real ones are: a
    masked position takes the model's masked attention, which holds more than an all-ones mask
    (8-13 % on the quickstart's BERT), so a budget the pre-flight passes runs the largest padded
    batch with that plan."""
    figures = {}
    for planner_name in ("full", "offload"):
        recipe = quick_recipe("budget=1GB", f"planner.name={planner_name}")
        trainer, config, planner, size = _trainer(recipe)
        with trainer.meter.activate():
            trainer.meter.track(trainer.model)
            needs = preflight(trainer, config, state_bytes=0)
            batch = make_batch(recipe, config, size)
            mask = batch["attention_mask"]
            mask.view(-1, mask.shape[-1])[:3, -20:] = 0  # three rows shorter than the longest
            least = planner.policy.least_memory()
            with trainer.meter.unlimited():
                padded = probe_with_plan(planner.parts, trainer.to_device(batch), least.plan)
        planner.close()
        assert padded <= needs.full_bytes <= padded * 1.01, (planner_name, padded, needs)
        figures[planner_name] = needs
    assert figures["offload"].least == "with every block offloaded"
    assert figures["offload"].full_bytes < figures["full"].full_bytes


def test_planners_with_one_plan_are_held_to_it():
    """``full`` with ``selective`` and ``offload`` run one plan only: the pre-flight's least figure
    is that plan's. Planner ``none`` is refused only below what every block checkpointed needs;
    above, it is let run (its running out of memory on the long batches is its answer), with a
    warning that points to a planner that checkpoints."""
    from mimose_cli.launcher.preflight import BudgetRange, budget_error, budget_warning, plan_in_words
    from mimose_cli.planners.blocks import recomputed
    from mimose_cli.planners.contract import Decision

    assert plan_in_words(Decision(("keep",) * 4), 4) == "without checkpointing"
    assert plan_in_words(Decision(("selective",) * 4), 4) == "with every block checkpointed selectively"
    assert plan_in_words(Decision(("offload",) * 4), 4) == "with every block offloaded"
    assert plan_in_words(Decision(recomputed((1, 2), 4)), 4) == "with 2 of 4 blocks checkpointed"
    needs = BudgetRange((16, 128), 500, 900, saves_memory=False)
    assert budget_error(800, needs, "800") is None and budget_warning(900, needs) is None
    assert "planner none will run out of memory on the longest batches" in budget_warning(800, needs, "800")
    assert budget_error(400, needs, "400") is not None  # below every plan: refused
    assert budget_warning(800, BudgetRange((16, 128), 500, 900)) is None  # a planner that checkpoints
    # full with selective: its one plan keeps more than whole blocks recomputed, and the error says so.
    from mimose_cli.planners.options import FullOptions

    assert FullOptions().leaner_setting() is None
    from torch import nn

    from mimose_cli.planners import build_planner

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with build_planner("full", model, None, blocks="*", selective=True) as planner:
        assert planner.parts.options.leaner_setting() == "planner.full.selective: false"
    leaner = BudgetRange((16, 128), 500, 900, leaner="planner.full.selective: false")
    said = budget_error(400, leaner, "400")
    assert "at least 500 B, set planner.full.selective: false (it needs less), or lower" in said
    assert "selective" not in budget_error(400, BudgetRange((16, 128), 500, 900), "400")


def test_a_dry_run_of_planner_none_under_its_need_says_it_will_run_out(tmp_path):
    result = CliRunner().invoke(app, ["train", str(QUICKSTART), "--planner", "none", "--budget", "40MB", "--dry-run",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert "planner none will run out of memory on the longest batches" in " ".join(result.output.split())
