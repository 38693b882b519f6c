"""Batches made for measuring: padded as real ones are (``inputs.with_padding``)."""

import pytest
import torch
from transformers import BatchEncoding

from mimose_cli.planners.inputs import with_padding


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
