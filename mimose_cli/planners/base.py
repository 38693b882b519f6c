"""The one planner interface every strategy (mimose and the baselines) implements."""

import contextlib
import time
from dataclasses import dataclass, field

import torch

from mimose_cli.planners.blocks import BlockRouter, RecomputeClock, discover_blocks, run_checkpointed
from mimose_cli.units import parse_size

TOKEN_KEYS = ("input_ids", "inputs_embeds", "pixel_values")


def infer_input_size(batch) -> tuple:
    """The input size a batch is planned for: (B, L) for tokens, (B, H, W) for images.

    Leading dimensions are folded into B, so a multiple-choice batch (B, C, L) is (B*C, L):
    that is the batch the encoder blocks actually see.
    """
    key, tensor = "input_ids", batch if isinstance(batch, torch.Tensor) else None
    if isinstance(batch, dict):
        key = next((k for k in TOKEN_KEYS if batch.get(k) is not None), None)
        tensor = batch.get(key)
    if tensor is None:
        raise ValueError(
            "cannot infer the input size from this batch: pass a tensor or a dict with "
            f"one of {TOKEN_KEYS}, or call planner.step(input_size=(B, L))"
        )
    shape = tuple(tensor.shape)
    if key == "inputs_embeds":
        shape = shape[:-1]  # the hidden dimension is not part of the input size
    if key == "pixel_values":
        return (shape[0],) + shape[-2:]
    if len(shape) == 1:
        return (1, shape[0])
    batch_size = 1
    for dim in shape[:-1]:
        batch_size *= dim
    return (batch_size, shape[-1])


@dataclass
class StepInfo:
    """What the planner decided for one step; filled in further by the planner after the step."""

    step: int
    input_size: tuple
    plan: tuple
    planning_ms: float
    phase: str = "responsive"
    cache_hit: bool | None = None
    predicted_peak_bytes: int | None = None
    extra: dict = field(default_factory=dict)


class Planner:
    """Decides, per batch, which blocks to checkpoint and applies that plan.

    Subclasses implement ``decide(input_size) -> plan`` and may override ``route`` (how a
    block runs) and ``observe`` (what is learned after a step). Usage::

        with planner.step(batch):
            model(**batch).loss.backward()
    """

    name = "base"

    def __init__(self, model, budget=None, *, blocks=None, safety_margin=0, meter=None):
        self.model = model
        self.budget_bytes = None if budget is None else parse_size(budget)
        self.safety_margin_bytes = parse_size(safety_margin or 0, allow_zero=True)
        self.blocks = blocks if isinstance(blocks, list) else discover_blocks(model, blocks)
        self.num_blocks = len(self.blocks)
        self.meter = meter
        self.plan: tuple = ()
        self._plan_set: frozenset = frozenset()
        self.steps = 0
        self.last: StepInfo | None = None
        self.total_planning_ms = 0.0
        self.recompute_clock = RecomputeClock()
        self.measurer = None  # a collector or profiler that runs the blocks while it is active
        self._router = BlockRouter(self.blocks, self.route)
        # A block that appends to a key/value cache cannot be recomputed or run twice, and a
        # training step never reads the cache (Hugging Face turns it off for checkpointing
        # too): off while the planner is attached, for every planner alike so that their
        # memory compares; close() puts the user's setting back for generate(). A sub-model
        # with a config of its own (T5's decoder) still hands its layers a cache: the router
        # clears it (blocks.training_kwargs).
        self._config = getattr(model, "config", None)
        self._use_cache = getattr(self._config, "use_cache", None)
        if self._use_cache:
            self._config.use_cache = False

    @property
    def limit_bytes(self):
        """The budget the planner aims for: budget minus the safety margin."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self.safety_margin_bytes

    def prepare(self, make_batch, max_input_size: tuple, reserve_bytes: int = 0) -> None:
        """Called once before training by the loop. ``make_batch(input_size)`` returns a
        training batch of that size on the device; ``max_input_size`` is the largest size the
        recipe allows; ``reserve_bytes`` is memory that is not allocated yet but will be for the
        whole run from the first optimizer step on (the optimizer's state), which a plan made now
        must leave room for. Static planners (sublinear) plan here; the default does nothing."""

    def decide(self, input_size: tuple) -> tuple:
        raise NotImplementedError

    def route(self, index, forward, args, kwargs):
        """Run block ``index``: through ``measurer`` while it measures, else checkpointed when it
        is in the current plan."""
        if self.measurer is not None and self.measurer.active:
            return self.measurer.route(index, forward, args, kwargs)
        if index in self._plan_set and torch.is_grad_enabled():
            return run_checkpointed(forward, args, kwargs, self.recompute_clock)
        return forward(*args, **kwargs)

    def observe(self, info: StepInfo, peak_bytes: int | None) -> None:
        """Called after each step with the measured peak (None when there is no meter)."""

    def set_plan(self, plan) -> None:
        self.plan = tuple(sorted(plan))
        self._plan_set = frozenset(self.plan)

    @contextlib.contextmanager
    def step(self, batch=None, input_size=None):
        """Decide and apply the plan for this batch; yields the ``StepInfo``."""
        size = tuple(input_size) if input_size is not None else infer_input_size(batch)
        start = time.perf_counter()
        self.last = self.make_step_info(size)
        self.recompute_clock.take()  # not this step's: a raised step's partial time, a planner's probe
        self.set_plan(self.last.plan)
        self.last.planning_ms = (time.perf_counter() - start) * 1e3
        self.total_planning_ms += self.last.planning_ms
        yield self.last
        recompute_ms = self.recompute_clock.take()
        self.last.extra.setdefault("recompute_ms", recompute_ms)  # DTR times its own
        peak = self.meter.peak_bytes() if self.meter is not None else None
        self.observe(self.last, peak)
        self.steps += 1

    def make_step_info(self, size: tuple) -> StepInfo:
        return StepInfo(step=self.steps, input_size=size, plan=tuple(self.decide(size)), planning_ms=0.0)

    @property
    def stats(self) -> dict:
        """Counters for reports; subclasses add their own."""
        return {"planner": self.name, "steps": self.steps, "num_blocks": self.num_blocks,
                "planning_ms_total": self.total_planning_ms}

    def state_dict(self) -> dict:
        return {"name": self.name, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state.get("steps", 0)

    def close(self) -> None:
        """Restore the blocks' original forwards and the model's ``use_cache``."""
        self._router.remove()
        if self._use_cache:
            self._config.use_cache = self._use_cache


class NoCheckpointing(Planner):
    """Checkpoint nothing: the speed limit, and out of memory on large batches."""

    name = "none"

    def decide(self, input_size):
        return ()


class FullCheckpointing(Planner):
    """Checkpoint every block, as ``gradient_checkpointing_enable()`` does."""

    name = "full"

    def decide(self, input_size):
        return tuple(range(self.num_blocks))
