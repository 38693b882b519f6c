"""What a recipe may set for each planner (its section: ``planner.mimose``, ``planner.sublinear``,
``planner.hf_every_n``): one small typed dataclass per planner, importable without torch, so
that a recipe is checked before anything is built. Each is the only place its planner's ranges
and rules live: a recipe, ``fit_budget`` and ``Planner(model, policy, **options)`` all build it
(``parse_options``), and the policy reads it (``PlannerParts.options``). What a planner's
messages suggest from its options (``oom_fix``, ``leaner_setting``) and the option ``mimose
compare --baselines name:value`` sets (``variant``) live here too, not in the policy.

Which options each planner takes is said once, in ``planners.registry``. Keywords only the
library can pass (DTR's ``cost_fn``, a function) are not options: a recipe cannot write them.
"""

import dataclasses
from typing import ClassVar, Literal, Optional, get_args

from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError
from pydantic.dataclasses import dataclass

_STRICT = ConfigDict(extra="forbid")  # strict scalars per field, as the recipe's
ChoiceSet = Literal["block", "selective", "offload"]
"""What a plan may do with each block (Mimose's and the oracle's ``choices``)."""


class OptionError(ValueError):
    """An option a planner does not take, or a value it cannot use: ``key``, ``value`` and what
    was expected, for the recipe (or ``fit_budget``) to name. Other options named in ``expected``
    are written ``{section}name``: bare here, ``planner.mimose.name`` in a recipe (``expected_in``)."""

    def __init__(self, key: str, value, expected: str):
        self.key, self.value, self._expected = key, value, expected
        self.expected = self.expected_in("")
        super().__init__(f"{key}={value!r} is invalid; expected {self.expected}")

    def expected_in(self, section: str) -> str:
        """``expected`` with the options it names written as keys of ``section`` ("" for bare names)."""
        return self._expected.replace("{section}", f"{section}." if section else "")


@dataclass(config=_STRICT, frozen=True)
class NoOptions:
    """A planner that takes no options; the defaults of what every options class answers."""

    variant_field: ClassVar[str | None] = None
    """The field ``mimose compare --baselines name:value`` sets (None: the planner has no variants)."""

    @classmethod
    def variants(cls) -> tuple:
        """The values ``variant_field`` may take (``sublinear:greedy|sqrt|chen``)."""
        if cls.variant_field is None:
            return ()
        return get_args(next(f.type for f in dataclasses.fields(cls) if f.name == cls.variant_field))

    def oom_fix(self) -> tuple:
        """What to suggest when a step runs out of memory for good, if not the default (raise the
        budget, shorter batches): never what the planner does already."""
        return ()

    def leaner_setting(self) -> str | None:
        """A setting that needs less memory than the planner's least-memory plan, named where a
        budget is below that plan (None: there is none)."""
        return None


@dataclass(config=_STRICT, frozen=True)
class MimoseOptions(NoOptions):
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
    choices: ChoiceSet = "block"
    """What a plan may do with each block: ``block``, keep it or recompute it whole (the paper's
    plans); ``selective``, also checkpoint it selectively (keep its matmuls', convolutions' and
    attention kernels' outputs, recompute the rest) where the probes measure that it frees the
    bytes needed for less recompute time; ``offload``, also offload a block instead of recomputing
    it where its copies to host memory and back, timed on this device before the first step, cost
    less (off by default: no GPU has measured the copies beside training yet). Needs
    ``estimate: probes``."""
    variant_field: ClassVar[str] = "choices"

    def __post_init__(self):
        if self.choices != "block" and self.estimate != "probes":
            raise OptionError("choices", self.choices,
                              "block with {section}estimate: sheltered (only the probes measure what a block holds "
                              "checkpointed selectively or offloaded); set {section}estimate: probes or "
                              "{section}choices: block")


@dataclass(config=_STRICT, frozen=True)
class SublinearOptions(NoOptions):
    variant: Literal["greedy", "sqrt", "chen"] = "greedy"
    """greedy (the paper's baseline), sqrt (Chen et al.'s every sqrt(n)-th block) or chen
    (Chen et al.'s budgeted segmentation)."""
    variant_field: ClassVar[str] = "variant"


@dataclass(config=_STRICT, frozen=True)
class EveryNOptions(NoOptions):
    every_n_layers: Optional[StrictInt] = Field(None, ge=1)
    """Checkpoint the blocks whose index is a multiple of this (transformers' ``every_n_layers``);
    null: the largest stride whose largest batch fits the budget, measured before training."""


@dataclass(config=_STRICT, frozen=True)
class NoneOptions(NoOptions):
    """``none`` takes no options; running out of memory is its answer, so it suggests a planner."""

    def oom_fix(self) -> tuple:
        return ("let a planner checkpoint (mimose), raise the budget, or lower the batch size or sequence length",)


@dataclass(config=_STRICT, frozen=True)
class FullOptions(NoOptions):
    selective: StrictBool = False
    """Checkpoint every block selectively: keep the outputs of its compute-heavy ops (matmuls,
    convolutions, attention kernels) and recompute the rest (torch's selective activation
    checkpointing), instead of recomputing its whole forward."""

    def leaner_setting(self) -> str | None:
        # Recomputing whole blocks keeps only their inputs: less than any selective plan.
        return "planner.full.selective: false" if self.selective else None

    def oom_fix(self) -> tuple:
        if not self.selective:
            return ()
        return (f"set {self.leaner_setting()} (whole blocks recomputed need less), raise the budget, "
                "or lower the batch size or sequence length",)


@dataclass(config=_STRICT, frozen=True)
class OracleOptions(NoOptions):
    choices: ChoiceSet = "block"
    """The plans it searches: ``block``, each block kept or recomputed; ``selective``, also
    checkpointed selectively; ``offload``, also offloaded where that costs less than a recompute
    (Mimose's ``choices``, so that "x oracle" compares like with like)."""
    variant_field: ClassVar[str] = "choices"


def parse_options(cls: type, options: dict, name: str):
    """Planner ``name``'s options, ``cls`` built from ``options`` (a mapping as a recipe writes
    it); raises ``OptionError`` for the first key it does not take or value it cannot use."""
    known = [f.name for f in dataclasses.fields(cls)]
    for key, value in options.items():
        if key not in known:
            takes = f"an option of {name}: {', '.join(known)}" if known else f"no options ({name} takes none)"
            raise OptionError(str(key), value, takes)
    try:
        return cls(**{str(key): value for key, value in options.items()})
    except ValidationError as err:
        first = err.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, OptionError):  # a rule of the class's own (``__post_init__``)
            raise cause from None
        expected = first["msg"].removeprefix("Input should be ")
        expected = "true or false" if expected == "a valid boolean" else expected
        raise OptionError(str(first["loc"][0]), first["input"], expected) from None
