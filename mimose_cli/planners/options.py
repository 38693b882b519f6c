"""What a recipe may set for each planner (its section: ``planner.mimose``, ``planner.sublinear``,
``planner.hf_every_n``): one small typed dataclass per planner, importable without torch, so
that a recipe is checked before anything is built.

Each field is a keyword of that planner's constructor with the same default (a test holds them
together); ``PLANNER_OPTIONS`` names every planner. Keywords only the library can pass (DTR's
``cost_fn``, a function) are not options: a recipe cannot write them.
"""

import dataclasses
from typing import Literal, Optional

from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError
from pydantic.dataclasses import dataclass

_STRICT = ConfigDict(extra="forbid")  # strict scalars per field, as the recipe's


@dataclass(config=_STRICT, frozen=True)
class MimoseOptions:
    estimate: Literal["probes", "sheltered"] = "probes"
    """Where the memory estimate comes from: ``probes``, two small measured steps before the
    first one, scaled to every size (the first batch is planned already); ``sheltered``, the
    paper's sheltered phase of measured training steps. ``probes`` falls back to ``sheltered``,
    saying why, where a model's memory cannot be scaled."""
    sheltered_steps: StrictInt = Field(5, ge=1)
    """Iterations of the sheltered (collecting) phase."""
    granularity: StrictInt = Field(1, ge=1)
    """The plan-cache key rounds the sequence length up to a multiple of this (1: every length
    planned exactly; larger values raise the hit rate but plan at the rounded-up size)."""
    bucket: StrictFloat = Field(0.10, ge=0.0, lt=1.0)
    """The greedy scheduler groups blocks whose predicted sizes are within this fraction."""
    prediction_margin: StrictFloat = Field(0.001, ge=0.0, lt=1.0)
    """Relative headroom on every predicted peak."""
    choices: Literal["block", "selective", "offload"] = "block"
    """What a plan may do with each block: ``block``, keep it or recompute it whole (the paper's
    plans); ``selective``, also checkpoint it selectively (keep its matmuls', convolutions' and
    attention kernels' outputs, recompute the rest) where the probes measure that it frees the
    bytes needed for less recompute time; ``offload``, also offload a block instead of recomputing
    it where its copies to host memory and back, timed on this device before the first step, cost
    less (off by default: no GPU has measured the copies beside training yet). Needs
    ``estimate: probes``."""


@dataclass(config=_STRICT, frozen=True)
class SublinearOptions:
    variant: Literal["greedy", "sqrt", "chen"] = "greedy"
    """greedy (the paper's baseline), sqrt (Chen et al.'s every sqrt(n)-th block) or chen
    (Chen et al.'s budgeted segmentation)."""


@dataclass(config=_STRICT, frozen=True)
class EveryNOptions:
    every_n_layers: Optional[StrictInt] = Field(None, ge=1)
    """Checkpoint the blocks whose index is a multiple of this (transformers' ``every_n_layers``);
    null: the largest stride whose largest batch fits the budget, measured before training."""


@dataclass(config=_STRICT, frozen=True)
class FullOptions:
    selective: StrictBool = False
    """Checkpoint every block selectively: keep the outputs of its compute-heavy ops (matmuls,
    convolutions, attention kernels) and recompute the rest (torch's selective activation
    checkpointing), instead of recomputing its whole forward."""


@dataclass(config=_STRICT, frozen=True)
class OracleOptions:
    choices: Literal["block", "selective", "offload"] = "block"
    """The plans it searches: ``block``, each block kept or recomputed; ``selective``, also
    checkpointed selectively; ``offload``, also offloaded where that costs less than a recompute
    (Mimose's ``choices``, so that "x oracle" compares like with like)."""


@dataclass(config=_STRICT, frozen=True)
class NoOptions:
    """A planner that takes no options."""


PLANNER_OPTIONS = {
    "mimose": MimoseOptions,
    "none": NoOptions,
    "full": FullOptions,
    "sublinear": SublinearOptions,
    "dtr": NoOptions,
    "oracle": OracleOptions,
    "hf-every-n": EveryNOptions,
    "offload": NoOptions,
}
"""Planner name -> the options a recipe may give it."""

PLANNER_NAMES = tuple(PLANNER_OPTIONS)


class OptionError(ValueError):
    """An option a planner does not take, or a value it cannot use: ``key``, ``value`` and what
    was expected, for the recipe (or ``fit_budget``) to name."""

    def __init__(self, key: str, value, expected: str):
        super().__init__(f"{key}={value!r} is invalid; expected {expected}")
        self.key, self.value, self.expected = key, value, expected


def parse_options(name: str, options: dict):
    """Planner ``name``'s options dataclass built from ``options`` (a mapping as a recipe writes
    it); raises ``OptionError`` for the first key it does not take or value it cannot use."""
    cls = PLANNER_OPTIONS[name]
    known = [f.name for f in dataclasses.fields(cls)]
    for key, value in options.items():
        if key not in known:
            takes = f"an option of {name}: {', '.join(known)}" if known else f"no options ({name} takes none)"
            raise OptionError(str(key), value, takes)
    try:
        return cls(**{str(key): value for key, value in options.items()})
    except ValidationError as err:
        first = err.errors()[0]
        expected = first["msg"].removeprefix("Input should be ")
        expected = "true or false" if expected == "a valid boolean" else expected
        raise OptionError(str(first["loc"][0]), first["input"], expected) from None
