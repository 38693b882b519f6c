"""Before the first step: can the budget run this recipe at all?

First the model's state (``check_model_state``): weights, gradients, the optimizer's state and its
step's scratch, which no plan changes. Then the budgets a step needs, measured at the largest
input the recipe allows (``preflight``).

Two side-effect-free steps (``planners.trial.probe_step``: RNG forked, buffers and gradients put
back) on a batch of the largest size, padded as real batches are (``inputs.with_padding``: a
masked position takes the models' masked code paths, which hold more), the budget lifted for them:
one with the planner's least-memory plan (``Policy.least_memory``: every block checkpointed, or
the one plan of ``full`` with ``selective`` and of ``offload``) and one with none (what runs
without checkpointing).
Memory that the first optimizer step allocates for good (the optimizer's state, and with gradient
accumulation the gradients set aside during a micro-batch) is added: the probes run before it
exists. A budget below the first figure cannot run the recipe with that planner; the run ends
before training with both figures.
"""

import warnings
from dataclasses import dataclass

import torch

from mimose_cli.launcher.data.loader import make_batch, max_input_size
from mimose_cli.launcher.sharding import held_param_bytes, is_sharded, largest_block_bytes, local_bytes
from mimose_cli.planners.base import Planner
from mimose_cli.planners.blocks import KEEP, OFFLOAD, SELECTIVE, checkpointed
from mimose_cli.planners.contract import Decision
from mimose_cli.planners.inputs import with_padding
from mimose_cli.planners.trial import probe_with_plan
from mimose_cli.units import format_budget, format_bytes


@dataclass
class BudgetRange:
    """What one training step at ``input_size`` needs, in bytes (None: more than the device has)."""

    input_size: tuple
    full_bytes: int | None
    """With the planner's least-memory plan (``least``: every block checkpointed, but for ``full``
    with ``selective`` and ``offload`` their one plan; the name is the planners' usual one): no
    budget below this runs the recipe with that planner."""
    none_bytes: int | None
    """With no block checkpointed: a budget of this much needs no checkpointing."""
    least: str = "with every block checkpointed"
    """The least-memory plan, in words (``Policy.least_memory``)."""
    saves_memory: bool = True
    """Whether the planner trades time for memory (``Policy.saves_memory``; not ``none``)."""
    leaner: str | None = None
    """A setting of the planner's that needs less memory than its least-memory plan
    (``options.leaner_setting``); None: none."""

    def describe(self) -> str:
        size = "x".join(str(d) for d in self.input_size)
        return (f"at its largest input ({size}) a step needs {_fmt(self.full_bytes)} {self.least} "
                f"and {_fmt(self.none_bytes)} without checkpointing")


def _fmt(value) -> str:
    return "more than the device holds" if value is None else format_bytes(value)


def measure_range(planner: Planner, batch, input_size: tuple, later_bytes: int) -> BudgetRange:
    """Measure the step's peak on ``batch`` with ``planner``'s least-memory plan and with no block
    checkpointed, through its plan runner, plus ``later_bytes``."""
    least = planner.policy.least_memory()
    peaks = []
    with planner.meter.unlimited(), planner.parts.probing():  # FSDP2: every rank runs them together
        for plan in (least.plan, (KEEP,) * planner.num_blocks):
            peak = probe_with_plan(planner.parts, batch, plan)
            peaks.append(None if peak is None else peak + later_bytes)
    return BudgetRange(tuple(input_size), *peaks, least=plan_in_words(least, planner.num_blocks),
                       saves_memory=planner.policy.saves_memory, leaner=planner.parts.options.leaner_setting())


def budget_error(budget_bytes: int | None, needs: BudgetRange, written: str | None = None) -> str | None:
    """Why ``budget_bytes`` (``written`` so by the user) cannot run the recipe (below what the
    planner's least-memory plan needs), or None when it can. Planner ``none`` above that is let
    run: running out of memory on the long batches is its answer (``budget_warning``)."""
    if budget_bytes is None or (needs.full_bytes is not None and budget_bytes >= needs.full_bytes):
        return None
    return (f"budget {format_budget(written, budget_bytes)} is too small for this recipe: {needs.describe()}. "
            f"Raise the budget to at least {_fmt(needs.full_bytes)}, "
            + (f"set {needs.leaner} (it needs less), " if needs.leaner else "")
            + "or lower training.batch_size or data.max_length")


def budget_warning(budget_bytes: int | None, needs: BudgetRange, written: str | None = None) -> str | None:
    """For a planner that never saves memory (``none``) under a budget its largest input needs more
    than: that the longest batches will run out of memory, or None."""
    if needs.saves_memory or budget_bytes is None or needs.none_bytes is None:
        return None
    if budget_bytes >= needs.none_bytes:
        return None
    return (f"budget {format_budget(written, budget_bytes)} is below what the largest input needs without "
            f"checkpointing ({_fmt(needs.none_bytes)}): planner none will run out of memory on the longest "
            "batches; a planner that checkpoints (mimose) needs less")


def budget_problem(budget_bytes: int | None, needs: BudgetRange, written: str | None = None) -> str | None:
    """What a dry run reports as not fitting: ``budget_error``'s refusal, else ``budget_warning``'s
    line for a planner that never saves memory, else None."""
    return budget_error(budget_bytes, needs, written) or budget_warning(budget_bytes, needs, written)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes the optimizer's state will take once its first step allocates it: Adam and AdamW
    keep two moments per parameter (three with amsgrad; plus a step count, not counted), SGD one
    momentum buffer when momentum is on. Other optimizers are not known here: 0, and a warning."""
    per_param = None
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        per_param = 2 + int(any(group.get("amsgrad") for group in optimizer.param_groups))
    if per_param is None and isinstance(optimizer, torch.optim.SGD):
        per_param = int(any(group.get("momentum", 0) for group in optimizer.param_groups))
    if per_param is None:
        warnings.warn(f"cannot size the state of {type(optimizer).__name__}; static plans "
                      "(sublinear) will not leave room for it", stacklevel=2)
        return 0
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return per_param * sum(local_bytes(p) for p in params)  # a sharded parameter's state is its shard's


def model_state_error(trainer, state_bytes: int) -> str | None:
    """Why the budget cannot hold what every iteration keeps whatever the plan — the weights
    (already on the meter), their gradients and the optimizer's ``state_bytes`` — or None when it
    can. Checkpointing only shrinks activations, so no planner could help."""
    budget = trainer.recipe.budget_bytes
    weights = trainer.meter.current_bytes()
    params = held_param_bytes(trainer.model)
    # With accumulation a micro-batch holds the gradients set aside (``StepGuard``) and its own.
    grads = params * (2 if trainer.recipe.training.gradient_accumulation_steps > 1 else 1)
    # The optimizer step runs after the activations are freed, on top of weights, gradients and
    # state; its scratch (AdamW: about one copy of the parameters, measured on the simulated
    # device) is what the loop must leave room for, since no plan changes it.
    scratch = params if state_bytes else 0
    # Sharded, a block's weights are gathered whole while it runs, and its gradients are whole
    # until they are reduce-scattered: whatever the plan, one block's of each.
    gathered = 2 * largest_block_bytes(trainer.planner.blocks, trainer.recipe.training.precision) if (
        is_sharded(trainer.model)) else 0
    total = weights + grads + state_bytes + scratch + gathered
    if budget is None or total <= budget:
        return None
    shards = f" (this rank's shards of {trainer.world.size})" if gathered else ""
    return (f"budget {format_budget(trainer.recipe.budget, budget)} cannot hold the model's state{shards} before "
            "any activation: "
            f"weights {format_bytes(weights)} + gradients {format_bytes(grads)} + "
            f"{type(trainer.optimizer).__name__} state {format_bytes(state_bytes)} + its step's scratch "
            f"{format_bytes(scratch)}"
            + (f" + the largest block gathered with its gradients {format_bytes(gathered)}" if gathered else "")
            + f" = {format_bytes(total)}; no checkpointing plan reduces these. Raise "
            "the budget well above that (activations come on top)"
            + (", shard over more processes" if gathered else "") + " or use a smaller model")


def check_model_state(trainer) -> tuple[int, str | None]:
    """Put the weights and optimizer on the meter; returns (optimizer state bytes, why the budget
    cannot hold the model's state or None). Weights alone over the budget are such a reason."""
    try:
        trainer.meter.track(trainer.model, trainer.optimizer)
    except torch.OutOfMemoryError:
        return 0, (f"budget {format_budget(trainer.recipe.budget, trainer.recipe.budget_bytes)} cannot hold the "
                   "model's weights "
                   f"({format_bytes(held_param_bytes(trainer.model))}); raise the budget well above that "
                   "or use a smaller model")
    state_bytes = optimizer_state_bytes(trainer.optimizer)
    return state_bytes, model_state_error(trainer, state_bytes)


class HostMemoryError(ValueError):
    """The recipe's largest batch cannot even be made in the machine's memory (the host's)."""


def preflight(trainer, config, state_bytes: int) -> BudgetRange:
    """The budgets the recipe needs at its largest input: besides the step, the
    optimizer's state and, with accumulation, the gradients set aside during a micro-batch.
    Raises ``HostMemoryError`` when that batch cannot be made."""
    recipe = trainer.recipe
    size = max_input_size(recipe)
    try:
        batch = trainer.to_device(with_padding(make_batch(recipe, config, size)))
    except MemoryError:  # the host, not the device: numpy or torch could not allocate the batch
        raise HostMemoryError(f"a batch of the largest input the recipe allows ({' x '.join(map(str, size))} "
                              "tokens) does not fit in this machine's memory; lower training.batch_size or "
                              "data.max_length") from None
    later = state_bytes + (held_param_bytes(trainer.model) if recipe.training.gradient_accumulation_steps > 1 else 0)
    return measure_range(trainer.planner, batch, size, later)


def plan_in_words(decision: Decision, num_blocks: int) -> str:
    """How a report says ``decision``'s plan: "with every block checkpointed", "... offloaded",
    "without checkpointing", or how many blocks it checkpoints."""
    plan, checkpointing = tuple(decision.plan), checkpointed(decision.plan)
    if len(checkpointing) == num_blocks:
        return "with every block checkpointed" + (" selectively" if plan == (SELECTIVE,) * num_blocks else "")
    if not checkpointing:
        return "with every block offloaded" if plan == (OFFLOAD,) * num_blocks else "without checkpointing"
    return f"with {len(checkpointing)} of {num_blocks} blocks checkpointed"
