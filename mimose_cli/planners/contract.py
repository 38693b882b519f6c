"""The policy contract: what a planner decides, and what it is told.

A planner is a policy (``Policy``) carried out by ``planners.base.Planner``. The planner builds
the parts a policy works with (``planners.parts.PlannerParts``: the model, its blocks, the budget,
the meter, the router, the plan runner) and constructs the policy on them, ``Policy(parts,
**options)``. Per step, ``decide(input_size, context) -> Decision`` says what to do with each
block for a batch of that size, from what the policy knows and what ``context`` (a
``StepContext``: the batch, the attempt, how ``run`` runs a batch) says of the step; after the
step ``observe(info, peak_bytes, sample)`` tells it what happened. The rest is optional, with
defaults below: ``prepare`` (before training: static plans, probes; ``prepare_from`` where the
loop did not call it), ``runner_for`` (a policy whose blocks run otherwise than by its plan: DTR),
``recover``, ``predict_peak`` and ``size_key`` (what out-of-memory recovery asks), ``stats`` and
``state_dict``. docs/DESIGN.md has a whole policy in 30 lines.
"""

from dataclasses import dataclass

from mimose_cli.planners.blocks import recompute_first


@dataclass
class Decision:
    """What a policy decides for one input size."""

    plan: tuple
    """One choice per block (``blocks.CHOICES``: keep, selective, partial1-3, recompute, offload),
    e.g. ``blocks.recompute_first(k, num_blocks)``."""
    phase: str | None = None
    """A label for reports (Mimose: sheltered, measuring, responsive, untrusted; any planner:
    recovery, a retry's plan); None: the policy has no phases."""
    cache_hit: bool | None = None
    """Whether the plan came from a cache (None: the planner has none)."""
    predicted_peak_bytes: int | None = None
    """The step peak the planner expects with this plan (None: it cannot say)."""
    measure: bool = False
    """Run this step through the policy's ``measurer`` (its runner while measuring) and hand
    what it measured to ``observe``."""
    excluded_ms: float = 0.0
    """Time deciding took that is not the step's (the oracle's measurements)."""


@dataclass(frozen=True)
class StepContext:
    """What a policy's ``decide`` may know of the step it decides for, besides its input size."""

    batch: object = None
    """The step's batch (None when only a size was given: ``step(input_size=...)``)."""
    attempt: int = 0
    """Attempts of this step that ran out of memory before this one (``Planner.run``)."""
    step_fn: object = None
    """How ``run`` runs a batch's forward and backward (its autocast, loss scaling); None in ``step``."""


NO_CONTEXT = StepContext()
"""The context of a decision asked for outside a step (a size alone)."""


@dataclass
class StepInfo:
    """One step as the planner ran it: its ``Decision``, and what the step reported back."""

    step: int
    input_size: tuple
    plan: tuple
    """One choice per block (``Decision.plan``; DTR: its evicted blocks recomputed)."""
    planning_ms: float = 0.0
    phase: str | None = None
    cache_hit: bool | None = None
    predicted_peak_bytes: int | None = None
    measured: bool = False
    excluded_ms: float = 0.0
    retries: int = 0
    """Attempts of this step that ran out of memory before this one (``Planner.run``)."""
    recompute_ms: float | None = None
    """Time recomputing blocks in backward (None: not measured)."""
    evictions: int | None = None
    """Blocks evicted (DTR; None for planners that do not evict)."""
    recomputations: int | None = None
    """Evicted blocks recomputed (DTR)."""
    step_ms: float = 0.0
    """Wall time inside ``planner.step``, planning included."""


class Policy:
    """The methods a policy writes (``decide``, the rest optional) and the facts it states."""

    name = "base"
    adapts = True
    """Whether out-of-memory recovery may change this policy's plan (``none`` and ``full`` are
    fixed by definition: ``none`` running out of memory is its answer, ``full`` has no more to give)."""
    max_retries = 2
    builds_meter = False
    """Without a ``meter``, build one (Mimose measures every step), on only inside ``step`` and
    ``run``: code between the steps runs as if there were no planner."""
    saves_memory = True
    """False: the policy never trades time for memory (``none``); the pre-flight then warns when
    its largest step needs more than the budget, and lets it run out of memory there."""
    state_file: str | None = None
    """The file in a run directory ``save`` writes, for planners whose state is worth keeping."""
    measurer = None
    """The runner of the steps decided with ``Decision(measure=True)`` (Mimose's and the oracle's
    collector); None: the policy measures nothing."""

    def __init__(self, parts):
        self.parts = parts
        """The ``PlannerParts`` this policy plans for: its only way into the model and the meter."""

    def decide(self, input_size: tuple, context: StepContext = NO_CONTEXT) -> Decision:
        """The plan for a batch of ``input_size``; ``context`` is the step's batch and attempt."""
        raise NotImplementedError

    def observe(self, info: StepInfo, peak_bytes: int | None, sample) -> None:
        """After each step: its ``StepInfo``, the measured peak (None without a meter) and what the
        measurer measured (None unless the step was decided with ``measure=True``)."""

    def prepare(self, make_batch, max_input_size: tuple, reserve_bytes: int = 0, step_fn=None) -> None:
        """Called once before training by the loop. ``make_batch(input_size)`` returns a
        training batch of that size on the device; ``max_input_size`` is the largest size the
        recipe allows; ``reserve_bytes`` is memory that is not allocated yet but will be for the
        whole run from the first optimizer step on (the optimizer's state), which a plan made now
        must leave room for; ``step_fn(batch)``, when given, runs a batch's forward and backward
        as training does (autocast, loss scaling: what ``run`` is given). Static planners
        (sublinear) plan here, Mimose takes its probe steps; the default does nothing."""

    needs_prepare = False
    """True while the policy wants ``prepare`` before its next ``decide`` (Mimose's probes): where
    the loop did not call it (a loop of the user's own), the planner calls ``prepare_from`` first."""

    def prepare_from(self, make_batch, input_size: tuple, step_fn=None) -> None:
        """``prepare`` from the first step, before its ``decide``, where the loop did not call it
        (``needs_prepare``): ``make_batch(input_size)`` is that step's batch cut or grown to a size
        (``inputs.resized_batch``; None when the step has no batch that can be), ``input_size`` its
        size and ``step_fn`` how ``run`` runs it. The default calls ``prepare`` when it can."""
        if make_batch is not None:
            self.prepare(make_batch, input_size, 0, step_fn)

    def prepared_note(self) -> str | None:
        """One line on what ``prepare`` did, for the run's log (None: nothing worth a line)."""
        return None

    def runner_for(self, info: StepInfo):
        """The ``blocks.BlockRunner`` of a step decided as ``info``: the measurer for a measured
        step, else the plan runner (the plan's blocks checkpointed, each as its choice says). A
        policy whose blocks run otherwise returns its own (DTR: its evictions)."""
        return self.measurer if info.measured else self.parts.plan_runner

    def recover(self, info: StepInfo, failures: int, reached_bytes: int) -> bool:
        """Make the next attempt of a step that ran out of memory ``failures`` times (the last
        trying to hold ``reached_bytes``) need less memory; False leaves it to the planner, which
        checkpoints every block for that size from then on (Mimose first tries a margin)."""
        return False

    def distrust(self, size: tuple) -> None:
        """Measure ``size`` before planning it from an estimate again: a step of that size ran out
        of memory in an earlier segment of the run (a resumed run). Nothing for a policy that
        does not estimate."""

    def least_memory(self) -> Decision:
        """The plan that runs a step in the least memory this policy can, which the pre-flight
        measures at the largest input (no budget below it runs the recipe with this policy): every
        block checkpointed, the planners' last resort; a policy whose one plan needs less or more
        (``full`` with ``selective``, ``offload``) returns that plan."""
        return Decision(recompute_first(self.parts.num_blocks, self.parts.num_blocks))

    def predict_peak(self, size: tuple, plan: tuple) -> int | None:
        """The step peak this policy predicts for ``plan`` (one choice per block) at ``size`` (None:
        it cannot say)."""
        return None

    def size_key(self, size: tuple) -> tuple:
        """The key recovery remembers a size by (Mimose: its plan-cache key)."""
        return tuple(size)

    def stats(self, counted: dict) -> dict:
        """Figures of the policy's own for reports, besides what the planner ``counted`` (steps,
        planning time, retries), which they may use."""
        return {}

    def state_dict(self) -> dict:
        """What the policy learned, as JSON-ready data (beside the planner's counters): enough for
        a resumed run to decide as the uninterrupted one would."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what ``state_dict`` gave (the planner's whole saved state)."""
