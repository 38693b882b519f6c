"""Batches made for measuring: padded as real ones are (``inputs.with_padding``)."""

import pytest
import torch
from transformers import BatchEncoding

from mimose_cli.planners.inputs import infer_input_size, resized_batch, with_padding


@pytest.mark.parametrize("mask", [
    torch.ones(2, 5, dtype=torch.long),
    torch.ones(2, 5, dtype=torch.bool),
    torch.ones(2, 3, 5, dtype=torch.long),  # multiple choice
    torch.ones(3, 2, 5, dtype=torch.long).permute(1, 0, 2),  # not contiguous
])
def test_a_measuring_batch_is_padded_as_real_ones_are(mask):
    """``with_padding`` masks the last row's last position (the masked code paths that real,
    padded batches take hold more), on a copy: the caller's mask stays as it was."""
    ids = torch.zeros(mask.shape, dtype=torch.long)
    padded = with_padding({"input_ids": ids, "attention_mask": mask})
    got = padded["attention_mask"]
    assert got.shape == mask.shape and got.dtype == mask.dtype and bool(mask.all())
    assert int((got == 0).sum()) == 1 and not got.flatten(0, -2)[-1, -1] and padded["input_ids"] is ids


def test_batches_without_a_mask_to_pad_come_back_as_they_are():
    ids = torch.zeros(2, 5, dtype=torch.long)
    for batch in (ids, {"input_ids": ids}, {"input_ids": ids, "attention_mask": torch.ones(2, 1)}):
        assert with_padding(batch) is batch
    padded = with_padding(BatchEncoding({"input_ids": ids, "attention_mask": torch.ones(2, 5)}))
    assert padded["attention_mask"][-1, -1] == 0 and padded["attention_mask"].sum() == 9


def _two_tower_batch(rows, length, side=32):
    return {"input_ids": torch.randint(0, 100, (rows, length)), "attention_mask": torch.ones(rows, length),
            "pixel_values": torch.randn(rows, 3, side, side)}


def test_a_two_tower_batch_is_sized_and_cut_by_its_text():
    """CLIP-like batches hold input_ids and pixel_values: the size is the text's, and cutting to
    another size cuts the text's length and every tensor's rows, never the images' sides (here
    as wide as the text is long)."""
    batch = _two_tower_batch(4, 32)
    assert infer_input_size(batch) == (4, 32)
    cut = resized_batch(batch, (2, 12))
    assert cut["input_ids"].shape == (2, 12) and cut["attention_mask"].shape == (2, 12)
    assert cut["pixel_values"].shape == (2, 3, 32, 32) and infer_input_size(cut) == (2, 12)


def test_mimose_trains_a_two_tower_model_inside_its_budget():
    """A CLIP-like model from config, text and images in one batch: the previous release's probes
    took it for an image batch and failed with an IndexError at the first step. It now trains
    inside the budget with the losses of the unplanned model."""
    import transformers

    from mimose_cli.memory import build_meter
    from mimose_cli.planners.mimose.policy import Mimose

    text = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=64)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=32, patch_size=8)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    torch.manual_seed(0)
    batches = [{**_two_tower_batch(rows, length), "return_loss": True}
               for rows, length in ((4, 20), (4, 9), (4, 33), (6, 24))]
    plain_model, planned_model = transformers.CLIPModel(config), transformers.CLIPModel(config)
    planned_model.load_state_dict(plain_model.state_dict())
    plain = [float(plain_model(**batch).loss) for batch in batches]
    budget = 30 * 2**20
    meter = build_meter("simulated", budget)
    with meter.activate(), Mimose(planned_model, budget, meter=meter) as planner:
        meter.track(planned_model)
        losses = []

        def step(batch):
            loss = planned_model(**batch).loss
            loss.backward()
            return loss.detach()

        for batch in batches:
            meter.reset_peak()
            losses.append(float(planner.run(step, batch)))
            planned_model.zero_grad(set_to_none=True)
            assert meter.peak_bytes() <= budget
        # The B x B similarities of the contrastive loss are read with the batch's square as a
        # feature: the probes are scaled (no sheltered phase), and a saved planner keeps that.
        assert planner.stats["estimate_source"] == "probes", planner.stats["estimate_fallback"]
        # 6 rows too: the probes' samples span three batch sizes
        assert planner.stats["untrusted_steps"] == 0, planner.stats["untrusted_reasons"]
        assert planner.policy.estimator.feature_set.names[-1] == "B2"
        state, predicted = planner.state_dict(), planner.policy.estimator.predict((6, 20)).step
    assert losses == pytest.approx(plain, rel=1e-5)
    with Mimose(planned_model, budget, meter=meter) as loaded:
        loaded.load_state_dict(state)
        assert loaded.policy.estimator.predict((6, 20)).step == predicted
