"""Mistakes in using a planner from code end in one line naming them, not an internal error or a
silent no-op."""

import gc
import warnings

import pytest
import torch

import mimose_cli

from helpers import bert_batch, require_allocator, tiny_bert


def _backward(model, batch):
    model(**batch).loss.backward()


def test_a_step_inside_a_step_is_refused():
    model, batch = tiny_bert(), bert_batch(2, 16)
    with mimose_cli.Mimose(model, "1GB", sheltered_steps=1) as planner:
        with pytest.raises(RuntimeError, match="inside another step of the same planner"):
            with planner.step(batch):
                with planner.step(batch):
                    _backward(model, batch)
        with pytest.raises(RuntimeError, match="planner.run inside a step"):
            planner.run(lambda b: planner.run(lambda c: _backward(model, c), b), batch)
        planner.run(lambda b: _backward(model, b), batch)  # and the planner still steps afterwards


def test_a_closed_planner_is_refused_and_a_model_takes_one_planner_at_a_time():
    model, batch = tiny_bert(), bert_batch(2, 16)
    first = mimose_cli.Mimose(model, "1GB")
    with pytest.raises(ValueError, match="already has a mimose planner attached; close\\(\\) it first"):
        mimose_cli.build_planner("full", model)
    first.close()
    with pytest.raises(RuntimeError, match="planner.run after close\\(\\)"):
        first.run(lambda b: _backward(model, b), batch)
    with pytest.raises(RuntimeError, match="planner.step after close\\(\\)"):
        first.step(batch)
    mimose_cli.build_planner("full", model).close()  # free once closed
    mimose_cli.build_planner("full", model)  # dropped without close(): its router is still in the blocks
    gc.collect()
    with pytest.raises(ValueError, match="already has a full planner attached"):
        mimose_cli.build_planner("none", model)


def test_step_without_with_warns_that_nothing_was_planned():
    model, batch = tiny_bert(), bert_batch(2, 16)
    with mimose_cli.Mimose(model, "1GB") as planner:
        with pytest.warns(RuntimeWarning, match="was never entered, so nothing was planned"):
            planner.step(batch)
            gc.collect()


def test_track_refuses_what_it_cannot_count():
    with mimose_cli.Mimose(tiny_bert(), "1GB") as planner:
        with pytest.raises(ValueError, match=r"track\('optimizer'\): expected a module, an optimizer, a tensor"):
            planner.track("optimizer", 42)
        planner.track({"kept": [bert_batch(2, 8)["input_ids"]]})  # nested tensors are fine


def test_a_compiled_model_on_the_simulated_device_is_said_to_run_eagerly():
    from mimose_cli.memory import build_meter

    model = tiny_bert()
    with pytest.warns(UserWarning, match="torch.compile'd, but on the simulated device it runs eagerly"):
        planner = mimose_cli.Mimose(torch.compile(model), "1GB", estimate="sheltered", sheltered_steps=1,
                                    meter=build_meter("simulated", 10**9))
    batch = bert_batch(2, 16)
    with planner:
        planner.run(lambda b: _backward(planner.model, b), batch)  # and it trains
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an uncompiled model is not warned about
        mimose_cli.Mimose(model, "1GB").close()


def test_a_whole_compiled_model_on_the_default_meter_is_refused_in_one_line():
    """The CPU's default meter (the counting allocator) runs compiled code compiled, so a whole
    compiled model would compile the planner's routing: refused, with the fix."""
    require_allocator()
    with pytest.raises(ValueError) as error:
        mimose_cli.Mimose(torch.compile(tiny_bert()), "1GB")
    assert "\n" not in str(error.value)
    assert str(error.value).endswith("pass the uncompiled model and compile=True (each block is compiled, "
                                     "the checkpoint stays outside)")


def test_blocks_compiled_in_place_on_the_simulated_device_are_named_in_the_warning():
    """Blocks the user compiled (not the whole model) on an explicit dispatch-mode meter: the
    warning says the blocks are compiled, not that the model is."""
    from mimose_cli.memory import build_meter

    model = tiny_bert()
    for layer in model.bert.encoder.layer:
        layer.compile(dynamic=True)
    with pytest.warns(UserWarning, match="the model's blocks are compiled, but on the simulated device"):
        mimose_cli.Mimose(model, "1GB", meter=build_meter("simulated", 10**9)).close()

def test_blocks_given_as_an_empty_or_mixed_list_are_refused_in_one_line():
    model = tiny_bert()
    for blocks in ([], ["bert.encoder.layer.0", ("x", model)]):
        with pytest.raises(ValueError, match="expected a glob, a non-empty list of globs, or of"):
            mimose_cli.Mimose(model, "1GB", blocks=blocks)
