"""Fixtures shared by the planner tests."""

from dataclasses import dataclass

import pytest

from mimose_cli.memory import build_meter
from mimose_cli.planners.mimose.policy import Mimose

from helpers import bert_batch, fitted_mimose, run_step, tiny_bert

SHELTERED_SIZES = ((4, 24), (2, 40), (3, 16), (4, 56), (2, 32), (3, 48))


@dataclass(frozen=True)
class Sheltered:
    """What Mimose's sheltered phase on ``tiny_bert`` left behind; read only."""

    sizes: tuple
    state: dict
    """``Mimose.state_dict()``: load it (``helpers.fitted_mimose``) to skip the phase."""
    samples: list
    """The estimator's samples, one ``(blocks, step)`` per sheltered step."""
    stats: dict


@pytest.fixture(scope="session")
def sheltered():
    """Mimose's sheltered phase, one step per size in SHELTERED_SIZES, run once per session
    (seconds of measuring runs); tests build planners from its state, never change it."""
    model = tiny_bert()
    meter = build_meter("simulated", 10**9)
    with meter.activate():
        meter.track(model)
        planner = Mimose(model, "1GB", meter=meter, estimate="sheltered", sheltered_steps=len(SHELTERED_SIZES))
        try:
            for size in SHELTERED_SIZES:
                run_step(planner, meter, bert_batch(*size))
            return Sheltered(SHELTERED_SIZES, planner.state_dict(), planner.policy.estimator.samples, planner.stats)
        finally:
            planner.close()


@pytest.fixture
def fitted(sheltered):
    """``(planner, meter)``: a fresh Mimose past the sheltered phase, budget 1GB."""
    with fitted_mimose(sheltered.state, sheltered_steps=len(sheltered.sizes)) as planner_and_meter:
        yield planner_and_meter
