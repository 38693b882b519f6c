"""What the library raises at a caller names the library's own arguments and concepts, never a
command-line flag (``--budget``): someone calling it from Python has no flags. The CLI says its
flags itself (tests/cli/test_bad_inputs.py)."""

import re
from types import SimpleNamespace

import pytest
import torch

from mimose_cli.launcher.preflight import model_state_error
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.resume import resume_recipe
from mimose_cli.launcher.sweep import planner_specs, run_compare
from mimose_cli.planners import build_planner
from mimose_cli.planners.blocks import discover_blocks

from helpers import QUICKSTART, tiny_bert

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
