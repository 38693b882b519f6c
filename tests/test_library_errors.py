"""What the library raises at a caller names the library's own arguments and concepts, never a
command-line flag (``--budget``): someone calling it from Python has no flags. The CLI says its
flags itself (tests/cli/test_bad_inputs.py)."""

import re
from types import SimpleNamespace

import pytest
import torch

from mimose_cli import Mimose, fit_budget
from mimose_cli.launcher.preflight import model_state_error
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.resume import resume_recipe
from mimose_cli.launcher.sweep import planner_specs, run_compare
from mimose_cli.planners import build_planner
from mimose_cli.planners.blocks import discover_blocks

from helpers import QUICKSTART, bert_batch, tiny_bert

FLAG = re.compile(r"(?<![\w-])--[a-z]")


def message_of(action, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as caught:
        action(*args, **kwargs)
    return str(caught.value)


def test_planner_and_block_errors_name_the_arguments():
    stack = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())  # nothing homogeneous
    messages = {
        "blocks='encoder.layer.*'": message_of(discover_blocks, stack),
        "blocks='zzz.*'": message_of(discover_blocks, tiny_bert(layers=2), "zzz.*"),
        "variant='fastest' is invalid": message_of(build_planner, "sublinear", tiny_bert(layers=2),
                                                   "1MB", variant="fastest"),
    }
    for named, message in messages.items():
        assert named in message and not FLAG.search(message), message


def test_run_and_compare_errors_name_no_flag(tmp_path):
    trainer = SimpleNamespace(
        recipe=SimpleNamespace(budget=None, budget_bytes=1000, training=SimpleNamespace(gradient_accumulation_steps=1)),
        meter=SimpleNamespace(current_bytes=lambda: 600), model=torch.nn.Linear(10, 10),
        optimizer=torch.optim.AdamW(torch.nn.Linear(10, 10).parameters()))
    messages = {
        "Raise the budget": model_state_error(trainer, state_bytes=880),
        "unknown planner 'dtx'": message_of(planner_specs, ["dtx"]),
        "budgets=": message_of(run_compare, load_recipe(QUICKSTART, ["budget=null"]), out=tmp_path / "c"),
        "budgets to compare: budget='lots'": message_of(run_compare, load_recipe(QUICKSTART),
                                                        budgets=["lots"], out=tmp_path / "c"),
        f"cannot resume {tmp_path}": message_of(resume_recipe, tmp_path),
    }
    for named, message in messages.items():
        assert named in message and not FLAG.search(message), message


def one_line(error, action, *args, **kwargs) -> str:
    """The message of the ``error`` that ``action(*args, **kwargs)`` raises, checked to be one line."""
    with pytest.raises(error) as caught:
        action(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and not FLAG.search(message), message
    return message


def test_a_planner_given_no_model_instance_says_what_it_got_and_how_to_get_one():
    from transformers import BertModel

    messages = {
        "model is the class BertModel: expected a model instance (a torch.nn.Module); build one first, "
        "e.g. BertModel(config)": one_line(TypeError, Mimose, BertModel, "1GB"),
        "model is the function tiny_bert: expected a model instance (a torch.nn.Module); call it and pass "
        "what it returns": one_line(TypeError, build_planner, "full", tiny_bert),
        "model is None: expected a model instance": one_line(TypeError, Mimose, None, "1GB"),
    }
    for named, message in messages.items():
        assert message.startswith(named), message


def test_prepare_given_a_bare_int_asks_for_a_batch_and_length():
    with Mimose(tiny_bert(layers=2), "1GB") as planner:
        message = one_line(ValueError, planner.prepare, lambda size: bert_batch(*size), 128)
    assert message.startswith("max_input_size=128 is invalid; expected (batch_size, max_length) as a tuple"), message


def test_fit_budget_given_no_trainer_says_to_build_one():
    from transformers import Trainer

    messages = {
        "trainer is the class Trainer: expected a built transformers.Trainer (or a subclass); build one first, "
        "e.g. Trainer(model=model": one_line(TypeError, fit_budget, Trainer, "1GB"),
        "trainer is a BertForSequenceClassification: expected a built transformers.Trainer (or a subclass); "
        "build the Trainer and pass it": one_line(TypeError, fit_budget, tiny_bert(layers=2), "1GB"),
    }
    for named, message in messages.items():
        assert message.startswith(named), message
