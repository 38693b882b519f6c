"""``training.compile: true`` in a recipe and ``TrainingArguments(torch_compile=True)`` under
``fit_budget``: each planned block compiled (``planners.compiled``), the same losses as eager,
compile time and recompiles in summary.json; what compiled blocks cannot do refused in one line.

Compiling costs seconds on this CPU: one tiny-BERT run per entry point, dropout off (compiled
dropout draws other random numbers than eager's), and inductor's on-disk cache makes the
second compile of the same graph quick."""

import warnings

import pytest
import torch

from mimose_cli.launcher.recipe import RecipeError
from mimose_cli.launcher.step import run_meter
from mimose_cli.launcher.train import run_training

NO_DROPOUT = "model.config_overrides={hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0}"
RUN = [NO_DROPOUT, "budget=40MB"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The cut quickstart eager and with ``training.compile: true`` (the allocator meter both,
    so that the peaks compare)."""
    from mimose_cli.launcher.recipe import load_recipe

    from helpers import QUICK_OVERRIDES, QUICKSTART

    out = tmp_path_factory.mktemp("runs")
    results = {}
    for compile_on in (False, True):
        recipe = load_recipe(QUICKSTART, QUICK_OVERRIDES + RUN + [f"out_dir={out}", "meter=allocator",
                                                                  f"training.compile={str(compile_on).lower()}"])
        results[compile_on] = run_training(recipe, view="none", save=False)
    return results


def test_a_compiled_run_trains_as_the_eager_one(runs):
    eager, compiled = runs[False], runs[True]
    assert compiled.summary["status"] == "completed" and compiled.summary["oom_steps"] == 0
    assert [r.loss for r in compiled.records] == pytest.approx([r.loss for r in eager.records], rel=1e-5)


def test_summary_has_the_compile_time_and_no_recompile_after_the_warmup(runs):
    planner = runs[True].summary["planner"]
    assert planner["compiled_blocks"] is True and planner["compile_s"] > 0
    assert 0 <= planner["compile_s_in_steps"] <= planner["compile_s"]
    assert planner["compile_s_in_steps"] * 1e3 <= sum(r.iter_ms for r in runs[True].records)
    assert planner["recompiles_after_warmup"] == 0
    assert "compiled_blocks" not in runs[False].summary["planner"]


def test_compile_picks_the_allocator_meter_on_the_cpu(quick_recipe):
    """Under the dispatch meter Dynamo is off: ``meter: auto`` becomes the allocator with
    compile on; an explicit ``meter: simulated`` stays (the planner says the blocks run eagerly)."""
    cpu = torch.device("cpu")
    assert run_meter(quick_recipe("training.compile=true"), cpu) == "allocator"
    assert run_meter(quick_recipe(), cpu) == "auto"  # the dispatch meter, without compile
    assert run_meter(quick_recipe("training.compile=true", "meter=simulated"), cpu) == "simulated"


@pytest.mark.parametrize("override, key", [
    ("planner.mimose.choices=selective", "planner.mimose.choices"),
    ("planner.full.selective=true", "planner.full.selective"),
])
def test_selective_checkpointing_with_compile_is_refused_in_one_line(quick_recipe, override, key):
    planner = "planner.name=full" if "full" in override else "planner.name=mimose"
    extra = ["planner.mimose.estimate=probes"] if "mimose" in override else []
    with pytest.raises(RecipeError) as error:
        quick_recipe("training.compile=true", planner, override, *extra)
    assert key in str(error.value) and "cannot see inside compiled blocks" in str(error.value)
    assert "\n" not in str(error.value)


def test_fit_budget_compiles_each_layer_not_the_whole_model():
    """``torch_compile=True``: the Trainer's whole-model compile is turned off (accelerate would
    compile the planner's routing too) and each layer is compiled by the planner instead."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from mimose_cli import fit_budget

    from helpers import tiny_bert

    def trainer(compile_on):
        model = tiny_bert(layers=2)
        model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        rows = [{"input_ids": torch.randint(0, 64, (8 + 4 * i,), generator=torch.Generator().manual_seed(i)),
                 "labels": i % 2} for i in range(6)]
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1, max_steps=4,
                                 logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                 disable_tqdm=True, seed=0, torch_compile=compile_on)
        return Trainer(model=model, args=args, train_dataset=rows)

    eager, compiled = trainer(False), trainer(True)
    fit_budget(eager, "1GB", "full")
    fitted = fit_budget(compiled, "1GB", "full")
    assert compiled.args.torch_compile is False and fitted.meter.kind == "allocator"
    seen = {}
    step = compiled.training_step

    def noted(*args, **kwargs):
        seen["compiled"] = fitted.planner.parts.compiled
        seen["wrapped"] = hasattr(compiled.model_wrapped, "_orig_mod") or hasattr(compiled.model, "_orig_mod")
        return step(*args, **kwargs)

    compiled.training_step = noted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager.train()
        compiled.train()
    assert seen["compiled"] is not None and not seen["wrapped"]
    losses = [[line["loss"] for line in t.state.log_history if "loss" in line] for t in (eager, compiled)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
