"""The image task: a CNN with stages (recipes/image_resnet.yaml) on synthetic images whose side
varies from batch to batch, planned from the first step."""

from pathlib import Path

import pytest
import torch

from mimose_cli.launcher.data.dataset import build_dataset
from mimose_cli.launcher.data.loader import build_dataloader, make_batch, max_input_size
from mimose_cli.launcher.models import model_config
from mimose_cli.launcher.recipe import RecipeError, load_recipe
from mimose_cli.launcher.train import run_training
from mimose_cli.planners.blocks import checkpointed

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "image_resnet.yaml"
SHORT = ["training.max_steps=8", "data.num_examples=32", "training.batch_size=2", "data.max_length=256"]


def _recipe(tmp_path, *overrides):
    return load_recipe(RECIPE, [*SHORT, f"out_dir={tmp_path}", *overrides])


def test_images_come_in_sides_that_vary_padded_to_each_batchs_largest(tmp_path):
    recipe = _recipe(tmp_path)
    config = model_config(recipe)
    dataset = build_dataset(recipe, config)
    sides = {example["side"] for example in dataset}
    assert len(sides) >= 3 and all(side % 32 == 0 and 32 <= side <= 256 for side in sides)
    for batch in build_dataloader(recipe, dataset, config):
        pixels = batch["pixel_values"]
        assert pixels.shape[:2] == (2, 3) and pixels.shape[2] == pixels.shape[3] and pixels.shape[2] in sides
        assert batch["labels"].dtype == torch.long
    assert max_input_size(recipe) == (2, 256, 256)
    assert make_batch(recipe, config, (2, 64, 96))["pixel_values"].shape == (2, 3, 64, 96)


@pytest.mark.parametrize("meter", ["simulated", "allocator"])
def test_a_resnet_is_planned_from_the_first_step_and_trains_as_without_a_plan(tmp_path, meter):
    """Every batch planned from the probes (sides 64 and 96 px); the run never over its budget,
    no retry; its losses equal those of the same steps unplanned. Bit for bit: a checkpointed
    block's recompute runs the same ops on the same inputs with the RNG put back (BatchNorm's
    batch statistics are recomputed, its running statistics restored), as torch guarantees for
    non-reentrant checkpointing. On the dispatch meter every prediction holds; the allocator meter
    also counts the scratch oneDNN's convolution backward allocates inside the op, which the
    probes' per-op timeline does not see: a step may then peak above its prediction, by at most
    2 % of the budget here, inside the budget, and the shortfall is carried into later predictions."""
    none = run_training(_recipe(tmp_path, "planner.name=none", "budget=1GB", f"meter={meter}"), view="none")
    budget = int(0.85 * max(r.fwd_bwd_peak_bytes for r in none.records))  # the largest must checkpoint
    mimose = run_training(_recipe(tmp_path, "planner.name=mimose", f"budget={budget}", f"meter={meter}"), view="none")
    stats = mimose.summary["planner"]
    assert mimose.summary["status"] == "completed" and mimose.summary["retries"] == 0
    assert stats["estimate_source"] == "probes" and not stats["probe_sides_refused"]
    assert stats["untrusted_steps"] == 0
    records = mimose.records
    if meter == "simulated":
        assert stats["underpredictions"] == 0
    else:
        assert all(r.fwd_bwd_peak_bytes - r.predicted_peak_bytes <= 0.02 * budget for r in records)
    assert len({tuple(r.input_size) for r in records}) >= 3  # sides that vary
    assert any(checkpointed(r.plan) for r in records) and any(not checkpointed(r.plan) for r in records)  # only the large checkpoint
    assert max(r.fwd_bwd_peak_bytes for r in records) <= budget
    assert [r.loss for r in records] == [r.loss for r in none.records]


@pytest.mark.parametrize("overrides, message", [
    (["data.preset=swag"], "data.preset='swag' is invalid; expected multiscale for task image_classification"),
    (["task=sequence_classification", "model.type=bert"], "expected swag | squad | qqp for task sequence_classification"),
    (["data.source=hf", "data.name=cifar10"], "synthetic for task image_classification"),
    (["data.max_length=16", "data.min_length=8"], "at least data.image_multiple (32)"),
])
def test_an_image_recipe_that_cannot_run_says_why_in_one_line(tmp_path, overrides, message):
    with pytest.raises(RecipeError) as error:
        _recipe(tmp_path, *overrides)
    assert message in str(error.value) and "\n" not in str(error.value)
