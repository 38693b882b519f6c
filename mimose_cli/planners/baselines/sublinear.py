"""Sublinear: one static plan, made before training for the largest input the recipe allows.

Variants (planner option ``variant``):
  - ``greedy`` (default): the Mimose paper's "Sublinear" baseline, its greedy scheduler evaluated
    once at the maximum input size from measured block sizes;
  - ``sqrt``: Chen et al.'s √n segmentation (arXiv 1604.06174): ⌈√n⌉ blocks per segment, every
    segment but the last recomputed (as ``torch.utils.checkpoint.checkpoint_sequential`` does:
    recomputing the last segment frees nothing, backward needs it at once);
  - ``chen``: Chen et al.'s budgeted greedy segmentation (their Algorithm 3) with the search over
    its segment budget, keeping the candidate with the least recompute time that fits.

Blocks stay the unit: a "recomputed segment" is its blocks each checkpointed, which recomputes
the same layers and holds no more memory than checkpointing the segment whole.
"""

import math
import time
from dataclasses import dataclass

import torch

from mimose_cli.memory.profiler import BlockProfiler
from mimose_cli.planners.base import Planner
from mimose_cli.planners.blocks import recomputed
from mimose_cli.planners.contract import NO_CONTEXT, Decision, Policy, StepContext
from mimose_cli.planners.mimose.scheduler import greedy_plan_checked
from mimose_cli.planners.trial import model_device, probe_with_plan, run_model, side_effect_free, to_model_device
from mimose_cli.planners.usage import warn_user


@dataclass
class BlockProfile:
    """Measured per-block activation bytes and forward ms at one input size.

    ``fixed_bytes`` is everything at the step's peak that no plan changes (weights, optimizer state,
    gradients, activations outside the blocks, backward transients); 0 when no meter is attached,
    in which case the budget applies to the blocks' activations alone.
    """

    input_size: tuple
    act_bytes: list
    fwd_ms: list
    fixed_bytes: int = 0

    def peak_bytes(self, plan) -> int:
        """Modelled peak of a step with ``plan`` checkpointed: the larger of the activations kept
        at the end of forward and, for each checkpointed block, the kept activations before it
        plus its own, which backward recomputes once the later blocks are freed."""
        plan = set(plan)
        kept = [0 if i in plan else b for i, b in enumerate(self.act_bytes)]
        peak, before = sum(kept), 0
        for i, size in enumerate(self.act_bytes):
            if i in plan:
                peak = max(peak, before + size)
            before += kept[i]
        return self.fixed_bytes + peak

    def recompute_ms(self, plan) -> float:
        return sum(self.fwd_ms[i] for i in plan)


def probe_plan(num_blocks: int) -> tuple:
    """The plan a calibration step runs: every block but the last. Recomputing the last block
    frees nothing (backward needs it at once), and leaving it plain puts a real backward of a
    block at the peak, which a checkpointed one hides (recomputation stops early and frees what
    backward has used)."""
    return tuple(range(num_blocks - 1))


def measure_fixed_bytes(parts, batch, act_bytes) -> int:
    """Run one side-effect-free step with ``probe_plan`` and return its measured peak less the
    modelled activations of that plan: the part of the peak no plan changes.

    Needs a meter (``parts``: a planner's ``PlannerParts``); returns 0 without one. The probe
    (``probe_step``) does not count as the step's peak.
    """
    if parts.meter is None:
        return 0
    plan = probe_plan(parts.num_blocks)
    peak = probe_with_plan(parts, batch, recomputed(plan, parts.num_blocks))
    if peak is None:  # nothing fits: make every plan but "all" look infeasible
        return parts.limit_bytes or 0
    return peak - BlockProfile((), act_bytes, [0.0] * len(act_bytes)).peak_bytes(plan)


def sqrt_plan(num_blocks: int) -> tuple:
    """√n segmentation: every block outside the last segment of ⌈√n⌉ blocks."""
    if num_blocks < 2:
        return ()
    segment = math.ceil(math.sqrt(num_blocks))
    last_start = ((num_blocks - 1) // segment) * segment
    return tuple(range(last_start))


def chen_segments(act_bytes, segment_budget: float) -> tuple:
    """Chen et al.'s Algorithm 3 over blocks: accumulate sizes in forward order; a block whose
    running total exceeds ``segment_budget`` is kept (a segment boundary) and the total restarts.

    Returns ``(kept, x, y)``: kept block indices, x = bytes of the kept blocks, y = the largest
    segment total. Every block not kept is recomputed.
    """
    temp, x, y, kept = 0, 0, 0, []
    for index, size in enumerate(act_bytes):
        temp += size
        if temp > segment_budget:
            x += size
            y = max(y, temp)
            kept.append(index)
            temp = 0
    return tuple(kept), x, max(y, temp)


def chen_budget_candidates(act_bytes, steps: int = 8) -> list:
    """The search grid for Algorithm 3's budget: √(x·y) from the run with budget 0 (Chen et al.'s
    starting estimate), scaled by 2^(k/4) for k in [-steps, steps]."""
    _, x0, y0 = chen_segments(act_bytes, 0)
    centre = math.sqrt(x0 * y0)
    return [centre * 2 ** (k / 4) for k in range(-steps, steps + 1)]


def chen_plan(profile: BlockProfile, limit_bytes) -> tuple:
    """Budgeted segmentation with budget search: among the grid's plans, the least recompute
    time that fits ``limit_bytes``; without a fit, the least memory ``x + y``. No plan when
    nothing needs checkpointing (no limit, or the step fits as it is): the grid never holds it."""
    if limit_bytes is None or profile.peak_bytes(()) <= limit_bytes:
        return ()
    candidates = []
    for budget in chen_budget_candidates(profile.act_bytes):
        kept, x, y = chen_segments(profile.act_bytes, budget)
        plan = tuple(i for i in range(len(profile.act_bytes)) if i not in kept)
        candidates.append((plan, x + y))
    fitting = [plan for plan, _ in candidates
               if limit_bytes is not None and profile.peak_bytes(plan) <= limit_bytes]
    if fitting:
        return min(fitting, key=lambda plan: (profile.recompute_ms(plan), len(plan), plan))
    return min(candidates, key=lambda item: (item[1], len(item[0])))[0]


def greedy_at(profile: BlockProfile, limit_bytes) -> tuple:
    """The Mimose greedy scheduler evaluated on measured sizes, re-checked against the modelled
    peak exactly as Mimose re-checks its predictions (``greedy_plan_checked``)."""
    if limit_bytes is None:
        return ()
    plan, _, _ = greedy_plan_checked(profile.act_bytes, profile.peak_bytes, limit_bytes)
    return plan


class SublinearPolicy(Policy):
    """A static plan for the largest input, applied to every batch."""

    name = "sublinear"

    def __init__(self, parts):
        super().__init__(parts)
        self.profiler = BlockProfiler(parts.model, parts.num_blocks)
        self.variant = parts.options.variant
        self.profile: BlockProfile | None = None
        self.static_plan: tuple | None = None
        self.prepare_ms = 0.0
        self.reserve_bytes = 0

    def prepare(self, make_batch, max_input_size: tuple, reserve_bytes: int = 0, step_fn=None) -> None:
        """Measure the blocks at the largest input and fix the plan, leaving ``reserve_bytes``
        (the optimizer state the first step will allocate) free."""
        start = time.perf_counter()
        self.reserve_bytes = int(reserve_bytes)
        if self.variant == "sqrt":
            self.static_plan = sqrt_plan(self.parts.num_blocks)
        else:
            self.static_plan = self._plan_at(make_batch, tuple(max_input_size))
        self.prepare_ms = (time.perf_counter() - start) * 1e3

    def _plan_at(self, make_batch, size: tuple) -> tuple:
        batch = to_model_device(self.parts.model, make_batch(size))
        try:
            with side_effect_free(self.parts.model, batch), torch.enable_grad(), self.parts.router.using(self.profiler):
                act_bytes, fwd_ms = self.profiler.measure(lambda: run_model(self.parts.model, batch),
                                                          model_device(self.parts.model))
        except torch.OutOfMemoryError:
            warn_user(f"sublinear: measuring one block at the largest input {size} ran out of "
                      "memory; checkpointing every block")
            return tuple(range(self.parts.num_blocks))
        fixed = measure_fixed_bytes(self.parts, batch, act_bytes)
        self.profile = BlockProfile(size, act_bytes, fwd_ms, fixed)
        planner = greedy_at if self.variant == "greedy" else chen_plan
        limit = None if self.parts.limit_bytes is None else self.parts.limit_bytes - self.reserve_bytes
        plan = planner(self.profile, limit)
        peak = self.profile.peak_bytes(plan)
        if limit is not None and peak > limit:
            warn_user(f"sublinear: at the largest input {size} even this plan {plan} is predicted "
                      f"to peak at {peak} bytes, over the {limit} available (budget less the optimizer "
                      "state); batches that long may run out of memory")
        return plan

    def decide(self, input_size: tuple, context: StepContext = NO_CONTEXT) -> Decision:
        if self.static_plan is None:
            raise RuntimeError("sublinear plans once for the largest input: call "
                               "planner.prepare(make_batch, max_input_size) before the first step")
        return Decision(recomputed(self.static_plan, self.parts.num_blocks))

    def stats(self, counted: dict) -> dict:
        return {"variant": self.variant, "prepare_ms": self.prepare_ms, "reserve_bytes": self.reserve_bytes,
                "static_plan": list(self.static_plan or ())}


def Sublinear(model, budget=None, **options) -> Planner:
    """``Planner(model, SublinearPolicy, budget, **options)`` (``variant``: greedy, chen, sqrt)."""
    return Planner(model, SublinearPolicy, budget, **options)
