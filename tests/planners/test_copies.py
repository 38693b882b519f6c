"""A model copied or saved while a planner is attached (an EMA or teacher copy, ``torch.save``)
is the plain model: its blocks run their own forward, with their own weights, into their own
gradients; the planner stays with the original."""

import copy
import io
import pickle

import pytest
import torch

import mimose_cli

from helpers import bert_batch, tiny_bert


def _assert_independent(original, twin, batch):
    """``twin`` computes with its own blocks' weights (changing one changes its output, not the
    original's) and its backward fills its own gradients, none of the original's."""
    original.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    twin(**batch).loss.backward()
    assert all(p.grad is None for p in original.parameters())
    assert all(p.grad is not None for p in twin.bert.encoder.layer.parameters())
    original.eval(), twin.eval()
    with torch.no_grad():
        twin.bert.encoder.layer[-1].output.dense.weight.zero_()  # a block's weight only
        assert not torch.allclose(twin(**batch).logits, original(**batch).logits)
    original.train(), twin.train()


def test_a_deep_copy_inside_the_planner_runs_its_own_blocks_also_after_close():
    model, batch = tiny_bert(layers=2), bert_batch(2, 8)
    with mimose_cli.Mimose(model, "1GB") as planner:
        twin = copy.deepcopy(model)
        _assert_independent(model, twin, batch)
        planner.run(lambda b: model(**b).loss.backward(), batch)  # the original is still planned
    _assert_independent(model, twin, batch)


def _pickled(model):
    return pickle.loads(pickle.dumps(model))


def _saved(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("round_trip", [_pickled, _saved], ids=["pickle", "torch.save"])
def test_a_model_saved_with_a_planner_attached_loads_as_the_plain_model(round_trip):
    model, batch = tiny_bert(layers=2), bert_batch(2, 8)
    with mimose_cli.Mimose(model, "1GB"):
        loaded = round_trip(model)
    state = model.state_dict()
    assert all(torch.equal(value, state[name]) for name, value in loaded.state_dict().items())
    _assert_independent(model, loaded, batch)
