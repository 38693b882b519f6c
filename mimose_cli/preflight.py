"""Before the first step: the budgets a recipe needs, measured at the largest input it allows.

Two side-effect-free steps (``planners.probe.probe_step``: RNG forked, buffers and gradients put
back) on a batch of the largest size, the budget lifted for them: one with every block
checkpointed (the least any plan can need) and one with none (what runs without checkpointing).
Memory that the first optimizer step allocates for good (the optimizer's state, and with gradient
accumulation the gradients set aside during a micro-batch) is added: the probes run before it
exists. A budget below the first figure cannot run the recipe, whatever the planner; the run
ends before training with both figures.
"""

from dataclasses import dataclass

from mimose_cli.planners import Planner
from mimose_cli.planners.probe import probe_step
from mimose_cli.units import format_bytes


@dataclass
class BudgetRange:
    """What one training step at ``input_size`` needs, in bytes (None: more than the device has)."""

    input_size: tuple
    full_bytes: int | None
    """With every block checkpointed: no budget below this runs the recipe."""
    none_bytes: int | None
    """With no block checkpointed: a budget of this much needs no checkpointing."""

    def describe(self) -> str:
        size = "x".join(str(d) for d in self.input_size)
        return (f"at its largest input ({size}) a step needs {_fmt(self.full_bytes)} with every block "
                f"checkpointed and {_fmt(self.none_bytes)} without checkpointing")


def _fmt(value) -> str:
    return "more than the device holds" if value is None else format_bytes(value)


def measure_range(planner: Planner, batch, input_size: tuple, later_bytes: int) -> BudgetRange:
    """Measure the step's peak on ``batch`` with every block checkpointed and with none, through
    ``planner``'s router (its own runner and measurer set aside meanwhile), plus ``later_bytes``."""
    meter = planner.meter
    saved = planner.runner, planner.measurer, planner.plan
    planner.runner, planner.measurer = planner.plan_runner, None
    peaks = []
    try:
        with meter.unlimited():
            for plan in (tuple(range(planner.num_blocks)), ()):
                planner.set_plan(plan)
                peak = probe_step(planner, batch)
                peaks.append(None if peak is None else peak + later_bytes)
    finally:
        planner.runner, planner.measurer = saved[:2]
        planner.set_plan(saved[2])
    return BudgetRange(tuple(input_size), *peaks)


def budget_error(budget_bytes: int | None, needs: BudgetRange) -> str | None:
    """Why ``budget_bytes`` cannot run the recipe (below what every block checkpointed needs), or
    None when it can."""
    if budget_bytes is None or (needs.full_bytes is not None and budget_bytes >= needs.full_bytes):
        return None
    return (f"budget {format_bytes(budget_bytes)} is too small for this recipe: {needs.describe()}. "
            f"Raise the budget to at least {_fmt(needs.full_bytes)}, or lower training.batch_size or "
            "data.max_length")
